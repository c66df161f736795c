"""meshy.dataplane: the column data plane of Meshy, built on TransferQueue.

Producers put rows (or add columns to rows) of typed tables; consumers declare (task, columns) and
lease rows, or whole groups of rows, whose columns are all ready; leases not acked in time return
to the pool. Ordered control streams and GPU token rings ride on the same servers.
"""

from meshy.dataplane.audit import SequenceAudit
from meshy.dataplane.client import Batch, DataPlaneClient, StreamMessage, StreamReader
from meshy.dataplane.config import DataPlaneConfig
from meshy.dataplane.devices import HOST, free_cached
from meshy.dataplane.endpoints import Endpoints
from meshy.dataplane.errors import (
    AccessDenied,
    DataPlaneError,
    DataPlaneTimeout,
    LeaseLostError,
    RingError,
    RowConflictError,
    SchemaError,
    ServerUnavailable,
    WeightSyncError,
)
from meshy.dataplane.gpu_ring import FALLBACK, ON_DEMAND, GpuTokenRing, Grant
from meshy.dataplane.schema import Column, TableSpec
from meshy.dataplane.server import DataPlaneServer, new_secret, secret_from_env
from meshy.dataplane.tables import AckResult

__all__ = [
    "FALLBACK",
    "HOST",
    "ON_DEMAND",
    "AccessDenied",
    "AckResult",
    "Batch",
    "Column",
    "DataPlaneClient",
    "DataPlaneConfig",
    "DataPlaneError",
    "DataPlaneServer",
    "DataPlaneTimeout",
    "Endpoints",
    "GpuTokenRing",
    "Grant",
    "LeaseLostError",
    "RingError",
    "RowConflictError",
    "SchemaError",
    "SequenceAudit",
    "ServerUnavailable",
    "StreamMessage",
    "StreamReader",
    "TableSpec",
    "WeightSyncError",
    "free_cached",
    "new_secret",
    "secret_from_env",
]
