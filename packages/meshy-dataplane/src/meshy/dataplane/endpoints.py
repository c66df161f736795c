"""Where the data-plane servers listen, and how every participant learns it."""

import json
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from meshy.dataplane.errors import ServerUnavailable

STORE_KEY = "meshy/dataplane/endpoints"


@dataclass(frozen=True)
class Endpoints:
    """The controller and the storage units, as TransferQueue describes servers (id, ip, ports), and the
    node each storage unit runs on (a client writes to its own node's units).

    The storage list's order is part of the contract: rows are routed by position in it.
    """

    controller: dict[str, Any]
    storage: tuple[dict[str, Any], ...]
    encrypted: bool
    storage_nodes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.storage_nodes:  # one host: every unit is on node 0
            object.__setattr__(self, "storage_nodes", (0,) * len(self.storage))

    def units_on(self, node: int) -> tuple[int, ...]:
        """Positions in `storage` of the units on `node`."""
        return tuple(u for u, at in enumerate(self.storage_nodes) if at == node)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Endpoints":
        data = json.loads(text)
        return cls(data["controller"], tuple(data["storage"]), data["encrypted"], tuple(data["storage_nodes"]))

    def publish(self, store: Any, key: str = STORE_KEY) -> None:
        """Write into a torch.distributed Store (e.g. torchrun's TCPStore) for every rank to read."""
        store.set(key, self.to_json())

    @classmethod
    def from_store(cls, store: Any, key: str = STORE_KEY, timeout_s: float = 300.0) -> "Endpoints":
        try:
            store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise ServerUnavailable(f"no data-plane endpoints under '{key}' after {timeout_s}s: {e}") from e
        return cls.from_json(store.get(key).decode())
