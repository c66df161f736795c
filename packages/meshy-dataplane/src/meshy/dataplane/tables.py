"""Controller-side state of one table: rows, column readiness per task, leases and acks.

Runs only inside the controller's single request thread, so it needs no locks. Every mutating method
validates its whole input before changing anything, so a rejected call leaves no trace.

A row's columns live in TransferQueue storage under storage keys (global indexes). Each write uses
fresh keys, so a late or duplicate writer can never overwrite committed data: the controller records
which key holds each committed column.
"""

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice

from meshy.dataplane.errors import LeaseLostError, RowConflictError, SchemaError
from meshy.dataplane.row_ranges import RowRanges
from meshy.dataplane.schema import TableSpec

MAX_RETIRED_RANGES = 1 << 16  # runs of consecutive retired row ids a table remembers (a few MB at most)


@dataclass(slots=True)
class _Row:
    group: int
    keys: dict[str, int] = field(default_factory=dict)  # column -> storage key
    done: set[str] = field(default_factory=set)  # tasks that acked this row


@dataclass(slots=True)
class _Task:
    columns: tuple[str, ...]
    whole_groups: bool
    ready: dict[int, None] = field(default_factory=dict)  # units (row or group ids) ready to lease, FIFO
    leased: dict[int, int] = field(default_factory=dict)  # unit -> lease id


@dataclass(slots=True)
class Lease:
    lease_id: int
    task: str
    consumer: str
    units: set[int]
    deadline: float
    granted: float


@dataclass(frozen=True)
class Leased:
    """What a lease hands out: rows in order, their groups, and where each needed column is stored."""

    lease_id: int
    deadline: float
    row_ids: list[int]
    group_ids: list[int]
    keys: dict[str, list[int]]


@dataclass
class AckResult:
    """acked: newly done. already: done before (acks are idempotent). stale: done, but the row was
    leased to another consumer at the time (its lease had expired). unknown: no such row (retired)."""

    acked: list[int] = field(default_factory=list)
    already: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)
    unknown: list[int] = field(default_factory=list)


class TableState:
    def __init__(self, spec: TableSpec):
        self.spec = spec
        self.rows: dict[int, _Row] = {}
        self.groups: dict[int, list[int]] = {}
        self.tasks: dict[str, _Task] = {}
        self.leases: dict[int, Lease] = {}
        self._expiry: list[tuple[float, int]] = []
        self._retire_after = set(spec.retire_after)
        self.retired = 0
        # every row its consumers retired (not those dropped), since the data plane started or was resumed: what a
        # producer started again asks for (`written`), so as not to write again a row consumed already
        self.retired_rows = RowRanges(MAX_RETIRED_RANGES)

    # ---- writes -------------------------------------------------------------------------------
    def check_commit(
        self, new: bool, row_ids: Sequence[int], group_ids: Sequence[int] | None, columns: Sequence[str]
    ) -> None:
        name = self.spec.name
        for c in columns:
            self.spec.column(c)
        if new:
            for r in row_ids:
                if r in self.rows:
                    raise RowConflictError(f"table '{name}': duplicate row id {r} (the row already exists)")
            if self.spec.group_size > 1:
                if group_ids is None or len(group_ids) != len(row_ids):
                    raise SchemaError(
                        f"table '{name}': group_ids: expected one group id per row "
                        f"(group_size is {self.spec.group_size})"
                    )
                added: dict[int, int] = {}
                for g in group_ids:
                    added[g] = added.get(g, 0) + 1
                for g, n in added.items():
                    have = len(self.groups.get(g, ()))
                    if have + n > self.spec.group_size:
                        raise RowConflictError(
                            f"table '{name}': group {g} would have {have + n} rows, "
                            f"over group_size {self.spec.group_size}"
                        )
            elif group_ids is not None:
                raise SchemaError(f"table '{name}': group_ids given, but group_size is 1")
        else:
            if group_ids is not None:
                raise SchemaError(f"table '{name}': group_ids are set when rows are put, not when columns are added")
            for r in row_ids:
                row = self.rows.get(r)
                if row is None:
                    raise RowConflictError(f"table '{name}': no row {r} to add columns to")
                for c in columns:
                    if c in row.keys:
                        raise RowConflictError(f"table '{name}': row {r} already has column '{c}'")

    def commit(
        self,
        new: bool,
        row_ids: Sequence[int],
        group_ids: Sequence[int] | None,
        columns: Sequence[str],
        keys: Sequence[int],
    ) -> None:
        """Make columns visible; call check_commit first."""
        touched_groups = set()
        for i, r in enumerate(row_ids):
            if new:
                g = group_ids[i] if group_ids is not None else r
                row = self.rows[r] = _Row(group=g)
                self.groups.setdefault(g, []).append(r)
            else:
                row = self.rows[r]
            for c in columns:
                row.keys[c] = keys[i]
            touched_groups.add(row.group)
        for task_name, task in self.tasks.items():
            if task.whole_groups:
                for g in touched_groups:
                    self._offer_group(task_name, task, g)
            else:
                for r in row_ids:
                    self._offer_row(task_name, task, r)

    def _row_ready(self, task_name: str, task: _Task, row: _Row) -> bool:
        return task_name not in row.done and all(c in row.keys for c in task.columns)

    def _offer_row(self, task_name: str, task: _Task, r: int) -> None:
        if r not in task.leased and r not in task.ready and self._row_ready(task_name, task, self.rows[r]):
            task.ready[r] = None

    def _offer_group(self, task_name: str, task: _Task, g: int) -> None:
        members = self.groups.get(g, ())
        if (
            len(members) == self.spec.group_size
            and g not in task.leased
            and g not in task.ready
            and all(self._row_ready(task_name, task, self.rows[r]) for r in members)
        ):
            task.ready[g] = None

    # ---- consumers ----------------------------------------------------------------------------
    def declare_task(self, task_name: str, columns: Sequence[str], whole_groups: bool) -> _Task:
        for c in columns:
            self.spec.column(c)
        task = self.tasks.get(task_name)
        if task is not None:
            if task.columns != tuple(columns) or task.whole_groups != whole_groups:
                raise SchemaError(
                    f"table '{self.spec.name}': task '{task_name}' was declared with columns "
                    f"{list(task.columns)} and whole_groups={task.whole_groups}, "
                    f"now asked with {list(columns)} and whole_groups={whole_groups}"
                )
            return task
        task = self.tasks[task_name] = _Task(columns=tuple(columns), whole_groups=whole_groups)
        if whole_groups:
            for g in self.groups:
                self._offer_group(task_name, task, g)
        else:
            for r in self.rows:
                self._offer_row(task_name, task, r)
        return task

    def lease(
        self,
        task_name: str,
        consumer: str,
        count: int,
        min_count: int,
        lease_s: float,
        now: float,
        lease_id: int,
        unit_range: tuple[int, int] | None = None,
    ) -> Leased | None:
        """Lease up to `count` units (rows, or whole groups), or None while fewer than min_count are ready.
        unit_range: only units with ids in [first, end)."""
        task = self.tasks[task_name]
        if len(task.ready) < min_count:
            return None
        first, end = unit_range if unit_range is not None else (None, None)
        ready = iter(task.ready) if first is None else (u for u in task.ready if first <= u < end)
        units = list(islice(ready, count))
        if len(units) < min_count:
            return None
        for unit in units:
            del task.ready[unit]
            task.leased[unit] = lease_id
        deadline = now + lease_s
        self.leases[lease_id] = Lease(lease_id, task_name, consumer, set(units), deadline, granted=now)
        heapq.heappush(self._expiry, (deadline, lease_id))
        row_ids = [r for g in units for r in self.groups[g]] if task.whole_groups else units
        rows = [self.rows[r] for r in row_ids]
        return Leased(
            lease_id=lease_id,
            deadline=deadline,
            row_ids=row_ids,
            group_ids=[row.group for row in rows],
            keys={c: [row.keys[c] for row in rows] for c in task.columns},
        )

    def check_ack(self, task_name: str, row_ids: Sequence[int]) -> None:
        task = self.tasks.get(task_name)
        if task is None:
            raise SchemaError(f"table '{self.spec.name}': task '{task_name}' has never leased from this table")
        if task.whole_groups:
            acked = set(row_ids)
            for r in row_ids:
                row = self.rows.get(r)
                if row is None:
                    continue
                missing = [m for m in self.groups[row.group] if m not in acked and task_name not in self.rows[m].done]
                if missing:
                    raise SchemaError(
                        f"table '{self.spec.name}': task '{task_name}' consumes whole groups; ack all rows of "
                        f"group {row.group} together (missing {missing})"
                    )

    def ack(self, task_name: str, row_ids: Sequence[int], consumer: str) -> tuple[AckResult, list[int]]:
        """Mark rows done for a task; call check_ack first. Returns the result and storage keys to free."""
        task = self.tasks[task_name]
        result = AckResult()
        candidates: list[int] = []
        for r in row_ids:
            row = self.rows.get(r)
            if row is None:
                result.unknown.append(r)
                continue
            if task_name in row.done:
                result.already.append(r)
                continue
            row.done.add(task_name)
            unit = row.group if task.whole_groups else r
            lease_id = task.leased.get(unit)
            if lease_id is not None:
                lease = self.leases[lease_id]
                (result.acked if lease.consumer == consumer else result.stale).append(r)
                if not task.whole_groups or all(task_name in self.rows[m].done for m in self.groups[unit]):
                    del task.leased[unit]
                    lease.units.discard(unit)
                    if not lease.units:
                        del self.leases[lease_id]
            else:
                result.acked.append(r)
                task.ready.pop(unit, None)
            candidates.append(r)
        return result, [k for r in candidates for k in self._retire_if_done(r)]

    def _retire_if_done(self, r: int) -> list[int]:
        """Retire a row once every retire_after task acked it and no other task's lease still holds it
        (a consumer that leased the row before it was retired can still write to it and ack it)."""
        row = self.rows.get(r)
        if row is None or not self._retire_after or not self._retire_after <= row.done:
            return []
        if any((row.group if t.whole_groups else r) in t.leased for t in self.tasks.values()):
            return []
        self.retired_rows.add(r)
        return self._retire(r)

    def _retire(self, r: int) -> list[int]:
        row = self.rows.pop(r)
        members = self.groups[row.group]
        members.remove(r)
        if not members:
            del self.groups[row.group]
        for task in self.tasks.values():
            task.ready.pop(row.group if task.whole_groups else r, None)
        self.retired += 1
        return sorted(set(row.keys.values()))

    def renew(self, lease_id: int, consumer: str, lease_s: float, now: float) -> list[int]:
        """Extend a lease; returns the rows still held. Raises LeaseLostError if nothing is held any more."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.consumer != consumer:
            raise LeaseLostError(f"table '{self.spec.name}': lease {lease_id} expired or was fully acked")
        lease.deadline = now + lease_s
        heapq.heappush(self._expiry, (lease.deadline, lease_id))
        task = self.tasks[lease.task]
        return [r for u in lease.units for r in (self.groups[u] if task.whole_groups else [u])]

    def release(self, lease_id: int, consumer: str) -> tuple[int, list[int]]:
        """Give back a lease's unacked rows now (a consumer that will not use them). Returns how many
        units, and the storage keys of rows this retires."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.consumer != consumer:
            return 0, []
        units = len(lease.units)
        return units, self._return_to_pool(lease)

    def release_consumer(self, consumer: str) -> tuple[int, list[int]]:
        """Give back every lease `consumer` holds now (a consumer known to be dead). Returns how many
        units, and the storage keys of rows this retires."""
        units, freed = 0, []
        for lease in [lease for lease in self.leases.values() if lease.consumer == consumer]:
            units += len(lease.units)
            freed += self._return_to_pool(lease)
        return units, freed

    def expire(self, now: float) -> tuple[bool, list[int]]:
        """Return expired leases' unacked units to the front of their task's pool. Returns whether any
        did, and the storage keys of rows this retires."""
        changed = False
        freed: list[int] = []
        while self._expiry and self._expiry[0][0] <= now:
            deadline, lease_id = heapq.heappop(self._expiry)
            lease = self.leases.get(lease_id)
            if lease is None or lease.deadline != deadline:
                continue  # acked, released, or renewed (a newer heap entry exists)
            freed.extend(self._return_to_pool(lease))
            changed = True
        return changed, freed

    def _return_to_pool(self, lease: Lease) -> list[int]:
        """A lease's unacked units go back to the front of its task's pool; rows whose life already
        ended (retire_after acked them while this lease held them) are retired instead."""
        del self.leases[lease.lease_id]
        task = self.tasks[lease.task]
        back = [u for u in lease.units if task.leased.get(u) == lease.lease_id]
        for u in back:
            del task.leased[u]
        task.ready = dict.fromkeys([*back, *task.ready])
        members = [r for u in back for r in (list(self.groups.get(u, ())) if task.whole_groups else [u])]
        return [k for r in members for k in self._retire_if_done(r)]

    def written(self, row_ids: Sequence[int]) -> list[int]:
        """Which of `row_ids` were put and not dropped: held now, or consumed and retired."""
        if self.retired_rows.overflowed:
            raise SchemaError(
                f"table '{self.spec.name}': its retired row ids left over {MAX_RETIRED_RANGES} gaps, past what it "
                "remembers; written() answers for tables whose row ids run on without gaps"
            )
        return [r for r in row_ids if r in self.rows or r in self.retired_rows]

    def check_drop(self, row_ids: Sequence[int]) -> None:
        for r in row_ids:
            row = self.rows.get(r)
            for name, task in self.tasks.items():
                if row is not None and (row.group if task.whole_groups else r) in task.leased:
                    raise SchemaError(f"table '{self.spec.name}': row {r} is leased for task '{name}'; not dropped")

    def drop(self, row_ids: Sequence[int]) -> list[int]:
        """End rows' life now, whatever tasks acked them (rows a resumed run cannot use; absent ones are
        skipped); call check_drop first (a leased row is refused). Returns their storage keys."""
        return [k for r in row_ids if r in self.rows for k in self._retire(r)]

    def snapshot(self) -> dict:
        """The table's state but its leases (what the controller's journal keeps)."""
        return {
            "spec": self.spec.to_wire(),
            "tasks": {name: [list(t.columns), t.whole_groups] for name, t in self.tasks.items()},
            "rows": [[r, row.group, row.keys, sorted(row.done)] for r, row in self.rows.items()],
            "retired": self.retired,
        }

    @classmethod
    def from_snapshot(cls, state: dict) -> "TableState":
        """A table as `snapshot` kept it, every row not yet done offered to its tasks again."""
        table = cls(TableSpec.from_wire(state["spec"]))
        for r, group, keys, done in state["rows"]:
            table.rows[r] = _Row(group, dict(keys), set(done))
            table.groups.setdefault(group, []).append(r)
        for name, (columns, whole_groups) in state["tasks"].items():
            table.declare_task(name, columns, whole_groups)
        table.retired = state["retired"]
        return table

    def next_deadline(self) -> float | None:
        return self._expiry[0][0] if self._expiry else None

    def waiting(self, now: float) -> dict:
        """Where each task's rows are: how many units (rows, or whole groups) are ready, who holds leases
        (consumer, rows, seconds since granted), and how many rows not yet given to it miss which columns
        (for a whole-groups task, a complete row waits for "the rest of its group")."""
        report = {}
        for name, task in self.tasks.items():
            missing: dict[str, int] = {}
            for r, row in self.rows.items():
                unit = row.group if task.whole_groups else r
                if name in row.done or unit in task.ready or unit in task.leased:
                    continue
                absent = ", ".join(c for c in task.columns if c not in row.keys) or "the rest of its group"
                missing[absent] = missing.get(absent, 0) + 1
            size = self.spec.group_size if task.whole_groups else 1
            leases = [
                {"consumer": lease.consumer, "rows": len(lease.units) * size, "held_s": round(now - lease.granted, 1)}
                for lease in self.leases.values()
                if lease.task == name
            ]
            report[name] = {"columns": list(task.columns), "ready": len(task.ready) * size, "leases": leases}
            report[name]["missing"] = missing
        return report

    def stats(self) -> dict:
        return {
            "rows": len(self.rows),
            "groups": len(self.groups),
            "retired": self.retired,
            "leases": len(self.leases),
            "tasks": {
                name: {
                    "ready": len(t.ready),
                    "leased": len(t.leased),
                    "done": sum(1 for row in self.rows.values() if name in row.done),
                }
                for name, t in self.tasks.items()
            },
        }
