"""One member's handle on a GPU token ring: roles that share devices pass the right to use them.

ON_DEMAND members call `acquire` when they have work and `release` when done. FALLBACK members hold
the token whenever nobody else asks; they call `poll` between units of work, which takes a grant made
to them and hands the token on as soon as someone waits. The holder's `on_release` (free device
memory) always runs before the release reaches the controller, so the next holder starts on free
devices; `on_acquire` gets the grant, whose payload is what the previous holder passed on (for
example the weights version to load).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from meshy.dataplane.audit import SequenceAudit
from meshy.dataplane.client import DataPlaneClient
from meshy.dataplane.errors import DataPlaneTimeout, RingError, SchemaError
from meshy.dataplane.rings import FALLBACK, ON_DEMAND, ledger_stream

__all__ = ["FALLBACK", "ON_DEMAND", "GpuTokenRing", "Grant"]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


@dataclass(frozen=True)
class Grant:
    seq: int
    holder: str
    previous: str | None
    payload: Any

    @classmethod
    def from_wire(cls, data: dict) -> "Grant":
        payload = _decoder.decode(data["payload"]) if data["payload"] else None
        return cls(data["seq"], data["holder"], data["previous"], payload)


class GpuTokenRing:
    def __init__(
        self,
        client: DataPlaneClient,
        ring: str,
        member: str,
        members: Sequence[tuple[str, str]],
        on_acquire: Callable[[Grant], None] | None = None,
        on_release: Callable[[], None] | None = None,
    ):
        modes = dict(members)
        if member not in modes:
            raise SchemaError(f"ring '{ring}': '{member}' is not among its members {list(modes)}")
        self.ring = ring
        self.member = member
        self.mode = modes[member]
        self._client = client
        self._on_acquire = on_acquire
        self._on_release = on_release
        self._held: Grant | None = None
        client._call("ring_declare", {"ring": ring, "member": member, "members": [list(m) for m in members]})
        self._seen_seq = 0
        self._ledger = client.reader(ledger_stream(ring), name=member, start="resume")

    @property
    def holding(self) -> bool:
        return self._held is not None

    @property
    def grant(self) -> Grant | None:
        """The grant this member holds the token under, if it holds it."""
        return self._held

    def _take(self, grant: Grant) -> Grant:
        if self._held is None or self._held.seq != grant.seq:
            self._held = grant
            if self._on_acquire is not None:
                self._on_acquire(grant)
        return self._held

    def acquire(self, timeout: float) -> Grant:
        """Wait for the token (running on_acquire once it arrives); DataPlaneTimeout if it does not."""
        args = {"ring": self.ring, "member": self.member}
        granted = self._client._wait_call("ring_request", args, timeout, done=bool)
        if not granted:
            self._client._call("ring_cancel", args)
            status = self._client._call("ring_status", {**args, "known_seq": -1, "wait_s": 0.0})
            raise DataPlaneTimeout(
                f"ring '{self.ring}': '{self.member}' did not get the token within {timeout}s "
                f"(held by '{status['holder']}')"
            )
        self.audit()
        return self._take(Grant.from_wire(granted))

    def release(self, payload: Any = None) -> None:
        """Run on_release, then hand the token on with `payload` for the next holder."""
        if self._held is None:
            raise RingError(f"ring '{self.ring}': '{self.member}' released a token it does not hold")
        if self._on_release is not None:
            self._on_release()
        data = _encoder.encode(payload) if payload is not None else b""
        self._client._call("ring_release", {"ring": self.ring, "member": self.member, "payload": data})
        self._held = None

    def poll(self, wait_s: float = 0.0) -> bool:
        """Take a grant made to this member; release at once if someone waits. Returns `holding`."""
        seen = self._seen_seq

        def changed(status: dict) -> bool:
            return status["seq"] != seen or (status["holder"] == self.member and bool(status["pending"]))

        args = {"ring": self.ring, "member": self.member, "known_seq": seen}
        status = self._client._wait_call("ring_status", args, wait_s, done=changed)
        self._seen_seq = status["seq"]
        if status["holder"] == self.member:
            self._take(Grant.from_wire(status["grant"]))
            if status["pending"]:
                self.release()
        elif self._held is not None:
            raise RingError(
                f"ring '{self.ring}': '{self.member}' thought it held the token, but '{status['holder']}' does"
            )
        self.audit()
        return self.holding

    def close(self) -> None:
        """Leave the ring: hand the token on if held, and stop pinning the grant ledger."""
        if self._held is not None:
            self.release()
        self._ledger.close()

    def audit(self) -> SequenceAudit:
        """Read the grant ledger up to now; the audit says whether grant numbers arrived without gaps."""
        while self._ledger.read(max_n=1024):
            pass
        return self._ledger.audit
