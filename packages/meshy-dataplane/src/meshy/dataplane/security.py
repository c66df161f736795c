"""Who may talk to the data plane: one secret per run, checked on every TCP connection.

TransferQueue's sockets unpickle what they receive, so an unauthenticated peer could run code in the
servers. Every server socket therefore runs a ZAP handshake: on loopback, ZMQ PLAIN with a password
derived from the run secret (no per-byte cost); off loopback, CURVE with keys derived from the secret
(encrypted, so the password never crosses a network in the clear). A peer without the secret never
gets a single frame delivered to server code.
"""

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from meshy.dataplane.errors import SchemaError

ZAP_DOMAIN = "meshy"
PLAIN_USER = "meshy"
MIN_SECRET_BYTES = 16
SECRET_ENV = "MESHY_DATAPLANE_SECRET"


@dataclass(frozen=True)
class Credentials:
    """Everything a server or client socket needs, derived from the run secret."""

    encrypted: bool
    password: bytes
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes, encrypted: bool) -> "Credentials":
        if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
            raise SchemaError(f"run secret: expected at least {MIN_SECRET_BYTES} bytes")

        def derive(label: bytes) -> bytes:
            return hmac.new(secret, label, hashlib.sha256).digest()

        server_secret = z85.encode(derive(b"meshy curve server"))
        client_secret = z85.encode(derive(b"meshy curve client"))
        return cls(
            encrypted=encrypted,
            password=derive(b"meshy plain").hex().encode(),
            server_public=zmq.curve_public(server_secret),
            server_secret=server_secret,
            client_public=zmq.curve_public(client_secret),
            client_secret=client_secret,
        )

    def secure_server(self, sock: zmq.Socket) -> None:
        """Require the handshake on a socket that will bind; call before bind."""
        _authenticator_for(sock.context, self)
        sock.zap_domain = ZAP_DOMAIN.encode()
        if self.encrypted:
            sock.curve_secretkey = self.server_secret
            sock.curve_publickey = self.server_public
            sock.curve_server = True
        else:
            sock.plain_server = True

    def secure_client(self, sock: zmq.Socket) -> None:
        """Present the run's credentials on a socket that will connect; call before connect."""
        if self.encrypted:
            sock.curve_serverkey = self.server_public
            sock.curve_publickey = self.client_public
            sock.curve_secretkey = self.client_secret
        else:
            sock.plain_username = PLAIN_USER.encode()
            sock.plain_password = self.password


class _ClientKeyCheck:
    """ZAP callback for CURVE: only the run's client key is let in."""

    def __init__(self, client_public: bytes):
        self._client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self._client_public)


# One ZAP handler per ZMQ context, kept alive for the life of the process.
_authenticators: dict[int, ThreadAuthenticator] = {}


def _authenticator_for(ctx: zmq.Context, creds: Credentials) -> ThreadAuthenticator:
    auth = _authenticators.get(id(ctx))
    if auth is None:
        auth = ThreadAuthenticator(ctx)
        auth.start()
        if creds.encrypted:
            auth.configure_curve_callback(ZAP_DOMAIN, _ClientKeyCheck(creds.client_public))
        else:
            auth.configure_plain(ZAP_DOMAIN, {PLAIN_USER: creds.password.decode()})
        _authenticators[id(ctx)] = auth
    return auth


def secure_transfer_queue_servers(host: str, creds: Credentials) -> None:
    """Make TransferQueue's controller and storage units bind `host` and authenticate every peer.

    TransferQueue creates all its sockets through `create_zmq_socket` and picks its address with
    `get_node_ip_address` (Ray's node IP, not loopback). In the server processes both are replaced:
    every ROUTER (the only sockets that accept TCP peers there) requires the run's credentials.
    """
    import transfer_queue.controller as tq_controller
    import transfer_queue.storage.simple_storage as tq_storage

    for module in (tq_controller, tq_storage):
        make_socket = module.create_zmq_socket

        def create_secured(ctx: zmq.Context, socket_type: Any, ip: str, identity: Any = None, _make=make_socket):
            sock = _make(ctx, socket_type, ip, identity)
            if socket_type == zmq.ROUTER:
                creds.secure_server(sock)
            return sock

        module.create_zmq_socket = create_secured
        module.get_node_ip_address = lambda: host
