"""One client socket to one data-plane server, telling a server that is gone from one that is slow.

A slow reply is not a dead server: on a loaded host a server process can stall for seconds (page
faults, CPU starvation) and answer later, so the reply deadline (`rpc_timeout_s`) is generous. A server
whose process ends closes its TCP connection; the socket's monitor sees that at once, so a pending
call fails then instead of at the deadline. A refused handshake (wrong run secret) is seen the same way.
"""

import functools
import operator
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from meshy.dataplane.errors import AccessDenied, DataPlaneError, ServerUnavailable
from meshy.dataplane.security import Credentials

_REFUSED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
}
CONTROLLER = "the data-plane controller"
_CANCEL_CHECK_S = 0.1  # how often a wait for a reply checks whether its client is closing
_WATCHED = functools.reduce(operator.or_, _REFUSED | {zmq.EVENT_DISCONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED})


class ServerConnection:
    """A DEALER socket connected to `address`, and what its monitor has seen of the connection.

    `name` says what the server is in error messages ("the data-plane controller", "storage unit X").
    """

    def __init__(self, ctx: zmq.Context, address: str, creds: Credentials, name: str, identity: bytes | None = None):
        self.address = address
        self.name = name
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.linger = 0
        if identity is not None:
            self.socket.identity = identity
        self._monitor = self.socket.get_monitor_socket(_WATCHED)
        self._handshakes = 0  # connections made so far
        self._up = False  # a handshake succeeded and that connection has not closed since
        self._refused = False
        self._sent_at = 0.0
        creds.secure_client(self.socket)
        self.socket.connect(address)

    def _observe(self) -> bool:
        """Take in the monitor's events; True if a connection closed (or was refused) among them."""
        closed = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshakes += 1
                self._up = True
            elif event in _REFUSED or (event == zmq.EVENT_DISCONNECTED and self._handshakes == 0):
                self._refused = True  # PLAIN reports a refusal; a CURVE server just hangs up on our hello
                closed = True
            elif event == zmq.EVENT_DISCONNECTED:
                self._up = False
                closed = True
        return closed

    @property
    def gone(self) -> bool:
        """The server refused us, or its connection closed and has not come back."""
        self._observe()
        return self._refused or (self._handshakes > 0 and not self._up)

    def send(self, frames: list, op: str, copy: bool = True) -> None:
        """Send a request; fails at once if the server is known to be gone."""
        if self.gone:
            if self._refused:
                raise self._refusal()
            raise ServerUnavailable(f"{self.name} at {self.address} closed its connection earlier; '{op}' was not sent")
        self.socket.send_multipart(frames, copy=copy)
        self._sent_at = time.monotonic()

    def wait_reply(self, op: str, deadline: float, closing: Callable[[], bool] = lambda: False) -> None:
        """Return once a reply can be read; ServerUnavailable if the connection closes first (its reply,
        if any, is lost with it) or if none comes by `deadline` (time.monotonic); DataPlaneError as soon
        as `closing()` says the client is being closed (it must not close this socket under the wait)."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            remaining = deadline - time.monotonic()
            events = dict(poller.poll(max(0.0, min(remaining, _CANCEL_CHECK_S)) * 1000))
            if self.socket in events:
                return
            if closing():
                raise DataPlaneError(f"the client was closed while '{op}' waited for {self.name}")
            if self._observe():
                if self._refused:
                    raise self._refusal()
                raise ServerUnavailable(
                    f"{self.name} at {self.address} closed its connection before answering '{op}' "
                    "(its process ended, or the network dropped the connection)"
                )
            if remaining <= 0:
                raise ServerUnavailable(
                    f"{self.name} at {self.address} did not answer '{op}' within {deadline - self._sent_at:.1f}s"
                )

    def _refusal(self) -> AccessDenied:
        return AccessDenied(
            f"{self.name} at {self.address} refused this client's credentials: the run secret does not match"
        )

    def close(self) -> None:
        self.socket.disable_monitor()
        self._monitor.close(linger=0)
        self.socket.close(linger=0)
