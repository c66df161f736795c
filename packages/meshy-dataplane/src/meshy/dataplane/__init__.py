"""meshy.dataplane: the column data plane of Meshy, built on TransferQueue.

Producers put rows (or add columns to rows) of typed tables; consumers declare (task, columns) and
lease rows, or whole groups of rows, whose columns are all ready; leases not acked in time return
to the pool. Ordered control streams and GPU token rings ride on the same servers.

Every name below is imported on first use (PEP 562): TransferQueue, which the client needs, costs seconds
to import (tensordict, torch's compiler stack, Ray), and a process that only reads a recipe or raises a
SchemaError should not pay for it.
"""

import importlib

from meshy.dataplane.moved_modules import keep_old_paths

_EXPORTS = {
    "meshy.dataplane.audit": ["SequenceAudit"],
    "meshy.dataplane.bursts": ["Bursts"],
    "meshy.dataplane.client": ["Batch", "DataPlaneClient", "Rows", "StreamMessage", "StreamReader"],
    "meshy.dataplane.config": ["DataPlaneConfig"],
    "meshy.dataplane.devices": ["HOST", "free_bytes", "free_cached"],
    "meshy.dataplane.endpoints": ["Endpoints"],
    "meshy.dataplane.errors": [
        "AccessDenied",
        "DataPlaneError",
        "DataPlaneTimeout",
        "LeaseLostError",
        "RingError",
        "RowConflictError",
        "SchemaError",
        "ServerUnavailable",
        "WeightSyncError",
    ],
    "meshy.dataplane.gpu_ring": ["FALLBACK", "ON_DEMAND", "GpuTokenRing", "Grant"],
    "meshy.dataplane.schema": ["Column", "TableSpec"],
    "meshy.dataplane.server": ["DataPlaneServer", "new_secret", "secret_from_env"],
    "meshy.dataplane.tables": ["AckResult"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'meshy.dataplane' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


keep_old_paths({"meshy.dataplane.rollout": "meshy.dataplane.columns"}, removed_in="0.3")
