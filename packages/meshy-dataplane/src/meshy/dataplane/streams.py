"""Controller-side state of one control stream: ordered, append-only, sequence-numbered messages.

Payloads are opaque bytes to the controller. Each named reader has a cursor (the next sequence it will
ask for); history every reader has passed is reclaimed, except the newest message, which stays so a
reader joining at "latest" finds it. With no named reader, and as a hard cap for laggards, at most
`retain` messages are kept: a reader that falls behind that far sees a gap, reported by its audit.
"""

import time
from collections import deque

from meshy.dataplane.errors import SchemaError

START_LATEST = "latest"
START_RESUME = "resume"


class StreamState:
    def __init__(self, name: str, retain: int):
        self.name = name
        self.retain = retain
        self.messages: deque[tuple[int, float, bytes]] = deque()
        self.next_seq = 1
        self.cursors: dict[str, int] = {}

    def append(self, payload: bytes) -> int:
        seq = self.next_seq
        self.next_seq += 1
        self.messages.append((seq, time.time(), payload))
        self._reclaim()
        return seq

    def resolve_start(self, reader: str, start: int | str) -> int:
        """The first sequence a reader wants, from an explicit sequence, "latest" or "resume"."""
        if isinstance(start, int) and not isinstance(start, bool) and start >= 1:
            return start
        if start == START_LATEST:
            return self.messages[-1][0] if self.messages else self.next_seq
        if start == START_RESUME:
            return self.cursors.get(reader, self.messages[0][0] if self.messages else self.next_seq)
        raise SchemaError(
            f"stream '{self.name}': start must be a sequence number >= 1, "
            f"'{START_LATEST}' or '{START_RESUME}', got {start!r}"
        )

    def read(self, reader: str, from_seq: int, max_n: int) -> list[tuple[int, float, bytes]]:
        """Messages with seq >= from_seq (possibly starting later, if reclaimed); moves the reader's cursor."""
        self.cursors[reader] = max(from_seq, self.cursors.get(reader, 0))
        out = []
        if max_n > 0 and self.messages and from_seq <= self.messages[-1][0]:
            first = self.messages[0][0]
            for i in range(max(0, from_seq - first), len(self.messages)):
                out.append(self.messages[i])
                if len(out) == max_n:
                    break
        self._reclaim()
        return out

    def close_reader(self, reader: str) -> None:
        self.cursors.pop(reader, None)
        self._reclaim()

    def _reclaim(self) -> None:
        floor = min(self.cursors.values()) if self.cursors else None
        while len(self.messages) > self.retain or (
            floor is not None and len(self.messages) > 1 and self.messages[0][0] < floor
        ):
            self.messages.popleft()

    def stats(self) -> dict:
        return {
            "retained": len(self.messages),
            "first": self.messages[0][0] if self.messages else self.next_seq,
            "next": self.next_seq,
            "readers": dict(self.cursors),
        }
