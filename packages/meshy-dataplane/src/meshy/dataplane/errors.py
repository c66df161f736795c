"""Every error the data plane raises, one class per thing a caller may want to handle."""


class DataPlaneError(Exception):
    """Base class of every data-plane error."""


class SchemaError(DataPlaneError, ValueError):
    """Input does not match a table's schema or a config's fields; nothing was written."""


class RowConflictError(DataPlaneError):
    """A write conflicts with rows already committed (duplicate row id, column written twice, unknown row)."""


class LeaseLostError(DataPlaneError):
    """Rows named in an ack or renewal are no longer held under the caller's lease."""


class ServerUnavailable(DataPlaneError, ConnectionError):
    """A data-plane server did not answer within the RPC timeout (dead, hung or unreachable)."""


class AccessDenied(ServerUnavailable):
    """A data-plane server refused this client's credentials (wrong or missing run secret)."""


class RingError(DataPlaneError):
    """A GPU token ring operation is not allowed in the ring's current state."""


class WeightSyncError(DataPlaneError):
    """A broadcast on the weight-sync group failed: a member died or did not join within the timeout."""


class DataPlaneTimeout(DataPlaneError, TimeoutError):
    """A wait (for a GPU token, for example) did not complete within its timeout."""


# Errors the controller sends back travel by class name; only these names are accepted.
REMOTE_ERRORS: dict[str, type[DataPlaneError]] = {
    cls.__name__: cls for cls in (SchemaError, RowConflictError, LeaseLostError, RingError, DataPlaneError)
}
