"""The data plane's settings, validated when constructed."""

import ipaddress
import math
from dataclasses import dataclass

from meshy.dataplane.errors import SchemaError
from meshy.dataplane.fields import check_fields
from meshy.dataplane.record_log import DurableMode


@dataclass(frozen=True)
class DataPlaneConfig:
    """How the data-plane servers run and how long clients wait for them."""

    host: str = "127.0.0.1"
    """Address the servers bind and advertise (never every interface). Loopback unless a multi-node run binds each
    node's own address."""
    num_storage_units: int = 1
    """TransferQueue storage-unit processes per host; rows are spread over them."""
    encrypt: bool | None = None
    """CURVE-encrypt every connection. None means: only when host is not loopback; off loopback it is always on
    (False is refused there: PLAIN would send the run's password in the clear)."""
    rpc_timeout_s: float = 30.0
    """Longest wait for one server reply before the server is declared unavailable. A server whose process ends is
    noticed at once (its connection closes); this bound is for one that hangs or whose host vanished, and is
    generous because a loaded host can stall a healthy server for seconds (a 5 s bound killed every role of a run
    beside a CI job)."""
    wait_slice_s: float = 1.0
    """Long waits (lease, stream read, token) are cut into slices of this length, so a hung controller is noticed
    within wait_slice_s + rpc_timeout_s."""
    start_timeout_s: float = 180.0
    """Longest wait for the servers to come up."""
    lease_s: float = 60.0
    """Default lease length; rows not acked within it return to their task's pool."""
    stream_retain: int = 1024
    """Most messages a control stream keeps; older ones are reclaimed even if unread."""
    alloc_block: int = 256
    """Storage keys a client reserves per controller round trip."""
    durable: DurableMode = "batched"
    """Keep the rows on disk too (with `durable_dir`): every storage unit appends what it stores to a log, and the
    controller journals its tables, so a data plane started again over the same directory (`meshy run --resume`)
    has every row that was not retired. "batched" fsyncs every `durable_sync_s`, "sync" before each write is
    answered, "off" keeps nothing. A killed process loses nothing in either mode (the writes are in the page
    cache); they differ for a host that loses power."""
    durable_dir: str | None = None
    """Where this host's logs go. `meshy run` sets the run directory's dataplane/node<N>/ unless the recipe
    names a local disk here; None: no logs (a data plane started by itself keeps rows in memory only)."""
    durable_sync_s: float = 0.1
    """How often "batched" fsyncs the logs while they have unsynced writes."""

    def __post_init__(self) -> None:
        check_fields(self)
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise SchemaError(f"DataPlaneConfig.host: expected an IP address, got {self.host!r}") from None
        if self.encrypt is False and not ipaddress.ip_address(self.host).is_loopback:
            raise SchemaError(
                f"DataPlaneConfig.encrypt: off loopback (host {self.host}) connections are always encrypted; "
                "False would send the run's password in the clear"
            )
        if ipaddress.ip_address(self.host).is_unspecified:
            raise SchemaError(f"DataPlaneConfig.host: {self.host} is every interface; expected one address")
        for name in ("num_storage_units", "stream_retain", "alloc_block"):
            if getattr(self, name) < 1:
                raise SchemaError(f"DataPlaneConfig.{name}: expected an integer >= 1, got {getattr(self, name)}")
        for name in ("rpc_timeout_s", "wait_slice_s", "start_timeout_s", "lease_s", "durable_sync_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise SchemaError(f"DataPlaneConfig.{name}: expected finite seconds > 0, got {getattr(self, name)}")

    @property
    def keeps_rows(self) -> bool:
        """Whether the servers log what they hold to disk."""
        return self.durable != "off" and self.durable_dir is not None

    @property
    def encrypted(self) -> bool:
        """Whether connections use CURVE (encrypted) rather than PLAIN (authenticated only)."""
        if self.encrypt is not None:
            return self.encrypt
        return not ipaddress.ip_address(self.host).is_loopback
