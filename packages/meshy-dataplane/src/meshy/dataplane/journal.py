"""The controller's journal: every change to its tables (schemas, tasks, rows, readiness, acks, drops) and
the storage keys it has handed out, read back when the controller starts again over the same directory.

Leases are not kept: whoever held them is gone when the controller starts again, so their rows are
offered again. Control streams and GPU token rings are not kept either: a resumed run's roles open them
anew. The journal is compacted (rewritten as one snapshot of the tables) once it is more than twice the
last snapshot plus `COMPACT_SLACK_BYTES`, so retiring rows bounds it.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshy.dataplane.record_log import DurableMode, RecordLog
from meshy.dataplane.schema import TableSpec
from meshy.dataplane.tables import TableState

COMPACT_SLACK_BYTES = 4 << 20
JOURNAL_FILE = "controller.log"


@dataclass
class Restored:
    tables: dict[str, TableState]
    high_water: int  # every storage key handed out is below it
    torn_bytes: int


class Journal:
    def __init__(self, log: RecordLog):
        self._log = log
        self._snapshot_bytes = 0

    @classmethod
    def open(cls, directory: Path, mode: DurableMode, sync_every_s: float) -> tuple["Journal", Restored]:
        log, contents = RecordLog.open(Path(directory) / JOURNAL_FILE, mode, sync_every_s)
        restored = Restored({}, 0, contents.torn_bytes)
        for record in contents.records:
            _replay(restored, record)
        return cls(log), restored

    def table(self, spec: TableSpec) -> None:
        self._log.append(("table", spec.to_wire()))

    def task(self, table: str, task: str, columns: Sequence[str], whole_groups: bool) -> None:
        self._log.append(("task", table, task, list(columns), whole_groups))

    def commit(
        self,
        table: str,
        new: bool,
        row_ids: Sequence[int],
        group_ids: Sequence[int] | None,
        columns: Sequence[str],
        keys: Sequence[int],
    ) -> None:
        self._log.append(("commit", table, new, list(row_ids), group_ids, list(columns), list(keys)))

    def ack(self, table: str, task: str, row_ids: Sequence[int]) -> None:
        self._log.append(("ack", table, task, list(row_ids)))

    def drop(self, table: str, row_ids: Sequence[int]) -> None:
        self._log.append(("drop", table, list(row_ids)))

    def high_water(self, key: int) -> None:
        self._log.append(("high_water", key))

    def compact_if_due(self, tables: dict[str, TableState], high_water: int) -> None:
        if self._log.size > 2 * self._snapshot_bytes + COMPACT_SLACK_BYTES:
            snapshot = {name: table.snapshot() for name, table in tables.items()}
            self._log.rewrite([("snapshot", snapshot, high_water)])
            self._snapshot_bytes = self._log.size

    @property
    def size(self) -> int:
        return self._log.size

    def close(self) -> None:
        self._log.close()


def _replay(restored: Restored, record: tuple) -> None:
    kind, tables = record[0], restored.tables
    if kind == "snapshot":
        restored.tables = {name: TableState.from_snapshot(state) for name, state in record[1].items()}
        restored.high_water = record[2]
    elif kind == "table":
        spec = TableSpec.from_wire(record[1])
        tables[spec.name] = TableState(spec)
    elif kind == "task":
        _, table, task, columns, whole_groups = record
        tables[table].declare_task(task, columns, whole_groups)
    elif kind == "commit":
        _, table, new, row_ids, group_ids, columns, keys = record
        tables[table].commit(new, row_ids, group_ids, columns, keys)
    elif kind == "ack":
        _, table, task, row_ids = record
        tables[table].ack(task, row_ids, consumer="")
    elif kind == "drop":
        tables[record[1]].drop(record[2])
    elif kind == "high_water":
        restored.high_water = max(restored.high_water, record[1])
    else:
        raise ValueError(f"journal: unknown record kind {kind!r}")
