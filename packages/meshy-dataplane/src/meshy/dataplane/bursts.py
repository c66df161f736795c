"""Leasing in bursts, for a consumer that pays for each burst of work: a role colocated in a GPU token
ring takes the devices from the others for every lease it works on, so leasing each row as soon as it is
ready would hand the devices back and forth for every few rows."""

import math
import time

from meshy.dataplane.errors import SchemaError


class Bursts:
    """How many ready rows the next lease waits for: `rows`, until `wait_s` have passed since the last
    burst; then whatever is ready (at least one), so rows that will not come (the last ones of a run, a
    share another process leased) delay the consumer by at most `wait_s`. Bursts() waits for nothing."""

    def __init__(self, rows: int = 1, wait_s: float = 0.0):
        if rows < 1:
            raise SchemaError(f"bursts rows: expected >= 1 rows to wait for, got {rows}")
        if not 0 <= wait_s < float("inf"):
            raise SchemaError(f"bursts wait_s: expected finite seconds >= 0, got {wait_s}")
        self.rows, self.wait_s = rows, wait_s
        self._last = time.monotonic()

    def min_count(self) -> int:
        """The ready rows the next lease waits for."""
        return self.rows if time.monotonic() - self._last < self.wait_s else 1

    def leased(self) -> None:
        """A burst was leased: the next one waits for `rows` again."""
        self._last = time.monotonic()


def check_burst_fields(config: object, limit: str) -> None:
    """SchemaError naming the field unless `config`'s burst_rows lies in 1..its field `limit` (the most rows
    one lease takes) and its burst_wait_s is finite seconds >= 0: what a config that feeds Bursts checks."""
    owner, rows, most = type(config).__name__, config.burst_rows, getattr(config, limit)
    if not 1 <= rows <= most:
        raise SchemaError(f"{owner}.burst_rows: expected 1 <= burst_rows <= {limit} ({most}), got {rows}")
    if not 0 <= config.burst_wait_s < math.inf:
        raise SchemaError(f"{owner}.burst_wait_s: expected finite seconds >= 0, got {config.burst_wait_s}")
