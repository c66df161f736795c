"""A storage unit's data kept in a log on local disk as well as in memory, and read back when the unit
starts again (a resumed run's rows are there again, under the same storage keys).

Every put and clear is appended to the log before it takes effect, so a unit that restarts holds exactly
what it held. The log is compacted (rewritten as the values it holds now) once it is more than twice
their size plus `COMPACT_SLACK_BYTES`, so retiring rows bounds it.
"""

from pathlib import Path
from typing import Any

from transfer_queue.storage.simple_storage import StorageUnitData

from meshy.dataplane.record_log import DurableMode, RecordLog

COMPACT_SLACK_BYTES = 8 << 20

_PUT = "put"
_CLEAR = "clear"


class DurableUnitData(StorageUnitData):
    def __init__(self, path: Path, mode: DurableMode, sync_every_s: float):
        super().__init__(None)
        self._log, contents = RecordLog.open(path, mode, sync_every_s)
        self.torn_bytes = contents.torn_bytes
        self._sizes: dict[int, float] = {}  # key -> its share of the log bytes that put it there
        self._live = 0.0
        for record, size in zip(contents.records, contents.sizes, strict=True):
            self._apply(record, size)

    def put_data(self, field_data: dict[str, Any], global_indexes: list) -> None:
        for name, values in field_data.items():
            if len(values) != len(global_indexes):
                raise ValueError(f"field '{name}': {len(values)} values for {len(global_indexes)} keys")
        record = (_PUT, list(global_indexes), {name: list(values) for name, values in field_data.items()})
        self._apply(record, self._log.append(record))
        self._compact_if_due()

    def clear(self, keys: list[int]) -> None:
        record = (_CLEAR, list(keys))
        self._apply(record, self._log.append(record))
        self._compact_if_due()

    def _apply(self, record: tuple, size: int) -> None:
        if record[0] == _PUT:
            _, keys, field_data = record
            super().put_data(field_data, keys)
            share = size / max(1, len(keys))
            for key in keys:
                self._sizes[key] = self._sizes.get(key, 0.0) + share
                self._live += share
        else:
            keys = record[1]
            super().clear(keys)
            for key in keys:
                self._live -= self._sizes.pop(key, 0.0)

    def _compact_if_due(self) -> None:
        if self._log.size > 2 * self._live + COMPACT_SLACK_BYTES:
            self._log.rewrite(self._records())

    def _records(self):
        """What the unit holds now, as one put per key."""
        for key in sorted(self._active_keys):
            values = {name: [column[key]] for name, column in self.field_data.items() if key in column}
            yield (_PUT, [key], values)

    @property
    def log_bytes(self) -> int:
        return self._log.size

    def close(self) -> None:
        self._log.close()
