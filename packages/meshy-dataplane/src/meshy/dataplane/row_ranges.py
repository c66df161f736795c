"""A set of row ids kept as sorted, disjoint [start, end) ranges: rows retire in long runs of consecutive
ids, so a table remembers every row it ever retired in a few ranges instead of one entry per row.

A table whose ids leave gaps (a multi-turn run's turns: a range per trajectory) would make as many ranges as
rows; past `max_ranges` the set gives up (`overflowed`) and holds nothing, so its memory stays bounded and a
question it can no longer answer is refused rather than answered wrong."""

import bisect


class RowRanges:
    def __init__(self, max_ranges: int) -> None:
        self.max_ranges = max_ranges
        self.overflowed = False
        self._starts: list[int] = []
        self._ends: list[int] = []

    def __contains__(self, row: int) -> bool:
        i = bisect.bisect_right(self._starts, row) - 1
        return i >= 0 and row < self._ends[i]

    def __len__(self) -> int:
        """How many ranges (not rows) it holds."""
        return len(self._starts)

    def add(self, row: int) -> None:
        if self.overflowed:
            return
        i = bisect.bisect_right(self._starts, row) - 1  # the range starting at or before row, if any
        if i >= 0 and row < self._ends[i]:
            return
        joins_left = i >= 0 and self._ends[i] == row
        joins_right = i + 1 < len(self._starts) and self._starts[i + 1] == row + 1
        if joins_left and joins_right:
            self._ends[i] = self._ends.pop(i + 1)
            del self._starts[i + 1]
        elif joins_left:
            self._ends[i] = row + 1
        elif joins_right:
            self._starts[i + 1] = row
        elif len(self._starts) == self.max_ranges:
            self.clear()
            self.overflowed = True
        else:
            self._starts.insert(i + 1, row)
            self._ends.insert(i + 1, row + 1)

    def clear(self) -> None:
        """Hold nothing, and answer again (from rows added from now on)."""
        self._starts.clear()
        self._ends.clear()
        self.overflowed = False
