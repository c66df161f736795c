"""Controller-side state of one GPU token ring: who holds the devices, who waits, and the grant ledger.

Exactly one member holds the token at a time. ON_DEMAND members ask for it; FALLBACK members get it
whenever it is released and nobody is waiting (the first FALLBACK in member order). Grants are numbered
1, 2, 3, ... with no gaps; the controller appends each to the ring's ledger stream.
"""

import time
from collections import deque
from dataclasses import dataclass

from meshy.dataplane.errors import RingError, SchemaError

ON_DEMAND = "on_demand"
FALLBACK = "fallback"
MODES = (ON_DEMAND, FALLBACK)


def ledger_stream(ring: str) -> str:
    return f"gpu.{ring}"


@dataclass(frozen=True)
class GrantRecord:
    seq: int
    holder: str
    previous: str | None
    payload: bytes

    def to_wire(self) -> dict:
        return {"seq": self.seq, "holder": self.holder, "previous": self.previous, "payload": self.payload}


class RingState:
    def __init__(self, name: str, members: list[tuple[str, str]]):
        if not members:
            raise SchemaError(f"ring '{name}': expected at least one member")
        names = [m for m, _ in members]
        if len(set(names)) != len(names):
            raise SchemaError(f"ring '{name}': member names must be unique, got {names}")
        for member, mode in members:
            if mode not in MODES:
                raise SchemaError(f"ring '{name}': member '{member}' has mode {mode!r}, expected one of {MODES}")
        self.name = name
        self.members = list(members)
        self.modes = dict(members)
        self.holder: str | None = None
        self.seq = 0
        self.grant: GrantRecord | None = None
        self.pending: deque[str] = deque()
        self._parked = b""  # payload of a release nobody received yet; goes with the next grant
        self.granted_at = time.monotonic()  # when the token last changed hands

    def start(self) -> GrantRecord | None:
        """The first grant, to the first FALLBACK member, if there is one."""
        fallback = self._fallback(exclude=None)
        return self._grant(fallback, b"") if fallback else None

    def _fallback(self, exclude: str | None) -> str | None:
        return next((m for m, mode in self.members if mode == FALLBACK and m != exclude), None)

    def _grant(self, member: str, payload: bytes) -> GrantRecord:
        self.seq += 1
        self.grant = GrantRecord(self.seq, member, self.holder, payload)
        self.holder = member
        self.granted_at = time.monotonic()
        return self.grant

    def check_member(self, member: str) -> None:
        if member not in self.modes:
            raise SchemaError(f"ring '{self.name}': '{member}' is not a member; members: {list(self.modes)}")

    def request(self, member: str) -> tuple[GrantRecord | None, GrantRecord | None]:
        """Returns (the member's current grant if it holds the token, a new grant to record if one was made)."""
        self.check_member(member)
        if self.holder == member:
            return self.grant, None
        if self.holder is None:
            grant = self._grant(member, self._parked)
            self._parked = b""
            return grant, grant
        if member not in self.pending:
            self.pending.append(member)
        return None, None

    def release(self, member: str, payload: bytes) -> GrantRecord | None:
        """The holder hands the token on: to the longest waiter, else a FALLBACK member, else nobody."""
        self.check_member(member)
        if self.holder != member:
            raise RingError(f"ring '{self.name}': '{member}' released the token, but '{self.holder}' holds it")
        nxt = self.pending.popleft() if self.pending else self._fallback(exclude=member)
        if nxt is None:
            self.holder = None
            self._parked = payload
            return None
        return self._grant(nxt, payload)

    def waiting(self, now: float) -> dict:
        """Who holds the token (None: nobody), for how long, and who waits for it (what a stall report says)."""
        return {"holder": self.holder, "seq": self.seq, "held_s": now - self.granted_at, "pending": list(self.pending)}

    def status(self) -> dict:
        return {
            "holder": self.holder,
            "seq": self.seq,
            "pending": list(self.pending),
            "grant": self.grant.to_wire() if self.grant else None,
        }
