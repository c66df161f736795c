"""Client-side I/O with TransferQueue storage units, over TransferQueue's own wire format.

Sync sockets, one request per unit in flight, all units in parallel: a put or get costs one round trip
to each unit it touches. Rows go to unit `key % num_units`.
"""

import itertools
import threading
import time
from typing import Any

import torch
import zmq
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType, format_zmq_address

from meshy.dataplane.errors import DataPlaneError, ServerUnavailable
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
        self._socks: list[zmq.Socket | None] = [None] * len(units)

    def _sock(self, u: int) -> zmq.Socket:
        sock = self._socks[u]
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.sndhwm = 0
            sock.rcvhwm = 0
            sock.identity = (
                f"{STORAGE_IDENTITY_PREFIX}{self._owner}_{threading.get_ident()}_{next(_socket_ids)}".encode()
            )
            self._creds.secure_client(sock)
            sock.connect(self._address(u))
            self._socks[u] = sock
        return sock

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

    def _exchange(self, requests: dict[int, tuple[ZMQRequestType, dict]], ok: ZMQRequestType) -> dict[int, Any]:
        for u, (kind, body) in requests.items():
            msg = ZMQMessage.create(kind, sender_id=self._owner, receiver_id=self._units[u]["id"], body=body)
            self._sock(u).send_multipart(msg.serialize(), copy=False)
        deadline = time.monotonic() + self._timeout
        replies = {}
        for u in requests:
            sock = self._sock(u)
            if not sock.poll(max(0.0, deadline - time.monotonic()) * 1000):
                self._drop(u)
                raise ServerUnavailable(
                    f"storage unit {self._units[u]['id']} at {self._address(u)} did not answer "
                    f"within rpc_timeout_s={self._timeout}"
                )
            reply = ZMQMessage.deserialize(sock.recv_multipart(copy=False))
            if reply.request_type != ok:
                raise DataPlaneError(f"storage unit {self._units[u]['id']}: {reply.body.get('message', reply.body)}")
            replies[u] = reply.body
        return replies

    def _drop(self, u: int) -> None:
        """A socket whose reply never came is poisoned (a late reply would be read as the next one's)."""
        sock = self._socks[u]
        if sock is not None:
            sock.close(linger=0)
            self._socks[u] = None

    def put(self, keys: list[int], values: dict[str, Any]) -> None:
        routes = self._route(keys)
        requests = {}
        for u, positions in routes.items():
            data = {name: _select(v, positions, len(keys)) for name, v in values.items()}
            requests[u] = (ZMQRequestType.PUT_DATA, {"global_indexes": [keys[i] for i in positions], "data": data})
        self._exchange(requests, ZMQRequestType.PUT_DATA_RESPONSE)

    def get(self, keys: list[int], fields: list[str]) -> dict[str, list]:
        """Per field, the values stored under `keys`, in key order."""
        routes = self._route(keys)
        requests = {
            u: (ZMQRequestType.GET_DATA, {"global_indexes": [keys[i] for i in positions], "fields": fields})
            for u, positions in routes.items()
        }
        replies = self._exchange(requests, ZMQRequestType.GET_DATA_RESPONSE)
        out: dict[str, list] = {f: [None] * len(keys) for f in fields}
        for u, positions in routes.items():
            data = replies[u]["data"]
            for f in fields:
                column = out[f]
                for i, value in zip(positions, data[f], strict=True):
                    column[i] = value
        return out

    def clear(self, keys: list[int]) -> None:
        requests = {
            u: (ZMQRequestType.CLEAR_DATA, {"global_indexes": [keys[i] for i in positions]})
            for u, positions in self._route(keys).items()
        }
        self._exchange(requests, ZMQRequestType.CLEAR_DATA_RESPONSE)

    def close(self) -> None:
        for u in range(len(self._socks)):
            self._drop(u)


def _select(value: Any, positions: list[int], n: int) -> Any:
    if len(positions) == n:
        return value
    if isinstance(value, torch.Tensor):
        return value[torch.tensor(positions, device=value.device)]
    return [value[i] for i in positions]
