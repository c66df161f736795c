"""Client-side I/O with TransferQueue storage units, over TransferQueue's own wire format.

Sync sockets, one request per unit in flight, all units in parallel: a put or get costs one round trip
to each unit it touches. Rows go to unit `key % num_units`.
Each stored value is one row's str or raw bytes (meshy.dataplane.schema.Column.to_storage).
"""

import itertools
import threading
import time
from typing import Any

import zmq
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType, format_zmq_address

from meshy.dataplane.connection import ServerConnection
from meshy.dataplane.errors import DataPlaneError
from meshy.dataplane.security import Credentials

# TransferQueue storage units drop requests from identities without the TQ_STORAGE_ prefix.
STORAGE_IDENTITY_PREFIX = "TQ_STORAGE_meshy_"
_socket_ids = itertools.count()


class StorageChannel:
    """One thread's connections to every storage unit (ZMQ sockets must stay on one thread)."""

    def __init__(self, ctx: zmq.Context, units: list[dict], creds: Credentials, rpc_timeout_s: float, owner: str):
        self._ctx = ctx
        self._units = units
        self._creds = creds
        self._timeout = rpc_timeout_s
        self._owner = owner
        self._conns: list[ServerConnection | None] = [None] * len(units)
        self.sent = [0] * len(units)  # request bytes sent to each unit, replies received from it
        self.received = [0] * len(units)

    def _connection(self, u: int) -> ServerConnection:
        conn = self._conns[u]
        if conn is None:
            identity = f"{STORAGE_IDENTITY_PREFIX}{self._owner}_{threading.get_ident()}_{next(_socket_ids)}".encode()
            conn = ServerConnection(
                self._ctx, self._address(u), self._creds, f"storage unit {self._units[u]['id']}", identity
            )
            conn.socket.sndhwm = 0
            conn.socket.rcvhwm = 0
            self._conns[u] = conn
        return conn

    def _address(self, u: int) -> str:
        unit = self._units[u]
        return format_zmq_address(unit["ip"], unit["ports"]["put_get_socket"])

    def _route(self, keys: list[int]) -> dict[int, list[int]]:
        """unit -> positions in `keys` stored there."""
        n = len(self._units)
        routes: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            routes.setdefault(k % n, []).append(i)
        return routes

    def _exchange(self, kind: ZMQRequestType, bodies: dict[int, dict], ok: ZMQRequestType) -> dict[int, Any]:
        """Send one request of `kind` to each unit in `bodies`, then collect every reply."""
        unanswered: list[int] = []
        try:
            for u, body in bodies.items():
                msg = ZMQMessage.create(kind, sender_id=self._owner, receiver_id=self._units[u]["id"], body=body)
                frames = msg.serialize()
                self._connection(u).send(frames, kind.name, copy=False)
                self.sent[u] += sum(_size(frame) for frame in frames)
                unanswered.append(u)
            deadline = time.monotonic() + self._timeout
            replies = {}
            for u in bodies:
                conn = self._connection(u)
                conn.wait_reply(kind.name, deadline)
                frames = conn.socket.recv_multipart(copy=False)
                self.received[u] += sum(_size(frame) for frame in frames)
                reply = ZMQMessage.deserialize(frames)
                unanswered.remove(u)
                if reply.request_type != ok:
                    raise DataPlaneError(
                        f"storage unit {self._units[u]['id']}: {reply.body.get('message', reply.body)}"
                    )
                replies[u] = reply.body
            return replies
        finally:
            for u in unanswered:
                if not self._connection(u).gone:
                    self._drop(u)  # its reply may still come, and would be read as the next call's

    def _drop(self, u: int) -> None:
        """A connection whose reply is late is poisoned (the late reply would be read as the next one's)."""
        conn = self._conns[u]
        if conn is not None:
            conn.close()
            self._conns[u] = None

    def put(self, keys: list[int], values: dict[str, Any]) -> None:
        routes = self._route(keys)
        bodies = {}
        for u, positions in routes.items():
            data = {name: _select(v, positions, len(keys)) for name, v in values.items()}
            bodies[u] = {"global_indexes": [keys[i] for i in positions], "data": data}
        self._exchange(ZMQRequestType.PUT_DATA, bodies, ZMQRequestType.PUT_DATA_RESPONSE)

    def get(self, keys: list[int], fields: list[str]) -> dict[str, list]:
        """Per field, the values stored under `keys`, in key order."""
        routes = self._route(keys)
        bodies = {
            u: {"global_indexes": [keys[i] for i in positions], "fields": fields} for u, positions in routes.items()
        }
        replies = self._exchange(ZMQRequestType.GET_DATA, bodies, ZMQRequestType.GET_DATA_RESPONSE)
        out: dict[str, list] = {f: [None] * len(keys) for f in fields}
        for u, positions in routes.items():
            data = replies[u]["data"]
            for f in fields:
                column = out[f]
                for i, value in zip(positions, data[f], strict=True):
                    column[i] = value
        return out

    def clear(self, keys: list[int]) -> None:
        bodies = {u: {"global_indexes": [keys[i] for i in positions]} for u, positions in self._route(keys).items()}
        self._exchange(ZMQRequestType.CLEAR_DATA, bodies, ZMQRequestType.CLEAR_DATA_RESPONSE)

    def close(self) -> None:
        for u in range(len(self._conns)):
            self._drop(u)


def _size(frame: Any) -> int:
    """Bytes in one frame TransferQueue serialised (bytes, or a buffer over a tensor's memory)."""
    return memoryview(frame).nbytes


def _select(values: list, positions: list[int], n: int) -> list:
    return values if len(positions) == n else [values[i] for i in positions]
