"""Checks that a stream of sequence numbers arrives exactly once and in order, and says what did not."""

from dataclasses import dataclass, field

OK = "ok"
GAP = "gap"
DUPLICATE = "duplicate"
REORDERED = "reordered"
MAX_GAP_RANGES = 1024


@dataclass
class SequenceAudit:
    """Feed it sequence numbers as they arrive; it classifies each one.

    gap: numbers were skipped (recorded as [first, last] missing ranges); reordered: a number that was
    skipped arrives late; duplicate: a number that was already seen arrives again.
    """

    next_expected: int | None = None
    received: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)
    reordered: list[int] = field(default_factory=list)
    _missing: list[list[int]] = field(default_factory=list)

    def observe(self, seq: int) -> str:
        self.received += 1
        if self.next_expected is None or seq == self.next_expected:
            self.next_expected = seq + 1
            return OK
        if seq > self.next_expected:
            self.gaps.append((self.next_expected, seq - 1))
            self._missing.append([self.next_expected, seq - 1])
            del self._missing[:-MAX_GAP_RANGES]
            self.next_expected = seq + 1
            return GAP
        for i, (lo, hi) in enumerate(self._missing):
            if lo <= seq <= hi:
                pieces = [[lo, seq - 1], [seq + 1, hi]]
                self._missing[i : i + 1] = [p for p in pieces if p[0] <= p[1]]
                self.reordered.append(seq)
                return REORDERED
        self.duplicates.append(seq)
        return DUPLICATE

    @property
    def clean(self) -> bool:
        return not (self.gaps or self.duplicates or self.reordered)

    def summary(self) -> dict:
        return {
            "received": self.received,
            "next_expected": self.next_expected,
            "gaps": list(self.gaps),
            "duplicates": list(self.duplicates),
            "reordered": list(self.reordered),
        }
