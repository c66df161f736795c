"""The data-plane client: tables, leased consumption, control streams.

Thread-safe: each thread gets its own sockets. Every call has a deadline: a server whose process ends
fails the call at once (its connection closes), one that does not answer within `rpc_timeout_s` raises
ServerUnavailable. Long waits are cut into `wait_slice_s` slices, so a controller that hangs during a
wait is noticed within a slice plus the RPC timeout.
"""

import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq
from transfer_queue.utils.zmq_utils import format_zmq_address

from meshy.dataplane.audit import DUPLICATE, SequenceAudit
from meshy.dataplane.config import DataPlaneConfig
from meshy.dataplane.connection import CONTROLLER, ServerConnection
from meshy.dataplane.endpoints import Endpoints
from meshy.dataplane.errors import (
    REMOTE_ERRORS,
    DataPlaneError,
    RowConflictError,
    SchemaError,
)
from meshy.dataplane.schema import TableSpec, check_row_ids
from meshy.dataplane.security import Credentials
from meshy.dataplane.storage_io import StorageChannel
from meshy.dataplane.streams import START_LATEST
from meshy.dataplane.tables import AckResult
from meshy.dataplane.wire import decode_reply, encode_request

log = logging.getLogger(__name__)
_payloads = msgspec.msgpack.Encoder()
_payload_decoder = msgspec.msgpack.Decoder()


@dataclass
class Batch:
    """Rows leased to one consumer of one task. Ack them (client.ack) before `deadline` (time.monotonic)."""

    table: str
    task: str
    lease_id: int
    deadline: float
    row_ids: list[int]
    group_ids: list[int]
    columns: dict[str, torch.Tensor | list]

    def __len__(self) -> int:
        return len(self.row_ids)


@dataclass
class Rows:
    """Every row of a table as it is now, read without a lease (`DataPlaneClient.peek`): ids, groups, the
    tasks that acked each, and per column asked for, each row's value (None where it has none yet)."""

    table: str
    row_ids: list[int]
    group_ids: list[int]
    done: list[set[str]]
    columns: dict[str, list]

    def __len__(self) -> int:
        return len(self.row_ids)


@dataclass(frozen=True)
class StreamMessage:
    seq: int
    time: float
    payload: Any


class DataPlaneClient:
    def __init__(
        self,
        endpoints: Endpoints,
        secret: bytes,
        config: DataPlaneConfig | None = None,
        name: str = "client",
        node: int | None = None,
    ):
        """node: the node this client runs on; what it writes goes to that node's storage units, so bulk
        data stays where it was produced until a consumer reads it (None: to any unit)."""
        self.config = config or DataPlaneConfig()
        self.endpoints = endpoints
        self._write_units = None if node is None else list(endpoints.units_on(node))
        if self._write_units == []:
            raise SchemaError(f"DataPlaneClient: node {node} has no storage unit; theirs: {endpoints.storage_nodes}")
        self.consumer_id = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._creds = Credentials.from_secret(secret, endpoints.encrypted)
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._request_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._connections: list[ServerConnection] = []
        self._storage_channels: list[StorageChannel] = []
        self._tables: dict[str, TableSpec] = {}
        self._free_keys: dict[str, list[int]] = {}
        self._closed = False
        self._closing = False  # set by close(): waits in progress end, new calls are refused
        self._in_use = 0  # calls using a socket now, on any thread
        self._uses = threading.Condition()
        self._check_access()

    # ---- transport ----------------------------------------------------------------------------
    @property
    def _controller_address(self) -> str:
        c = self.endpoints.controller
        return format_zmq_address(c["ip"], c["ports"]["request_handle_socket"])

    def _controller(self) -> ServerConnection:
        conn = getattr(self._local, "controller", None)
        if conn is None:
            if self._closed:
                raise DataPlaneError("the client is closed")
            conn = ServerConnection(self._ctx, self._controller_address, self._creds, CONTROLLER)
            self._local.controller = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def _storage(self) -> StorageChannel:
        channel = getattr(self._local, "storage", None)
        if channel is None:
            channel = StorageChannel(
                self._ctx, list(self.endpoints.storage), self._creds, self.config.rpc_timeout_s, self.consumer_id
            )
            self._local.storage = channel
            with self._lock:
                self._storage_channels.append(channel)
        return channel

    @contextlib.contextmanager
    def _using_sockets(self) -> Iterator[None]:
        """Around every use of a socket: close() closes none while another thread is inside one (a
        ZMQ socket closed under a thread that uses it can crash the process)."""
        with self._uses:
            if self._closing:
                raise DataPlaneError("the client is closed")
            self._in_use += 1
        try:
            yield
        finally:
            with self._uses:
                self._in_use -= 1
                self._uses.notify_all()

    def _check_access(self) -> None:
        """Ping the controller once, so refused credentials or a server that is down fail here."""
        self._call("ping", {})

    def _call(self, op: str, args: dict, timeout_s: float | None = None) -> Any:
        with self._using_sockets():
            conn = self._controller()
            request_id = next(self._request_ids)
            conn.send(encode_request(op, request_id, args), op)
            deadline = time.monotonic() + (timeout_s or self.config.rpc_timeout_s)
            while True:
                conn.wait_reply(op, deadline, closing=lambda: self._closing)
                reply = decode_reply(conn.socket.recv())
                if reply["id"] != request_id:
                    continue  # the late reply of a call that timed out earlier
                if reply["ok"]:
                    return reply["result"]
                error = reply["error"]
                raise REMOTE_ERRORS.get(error["kind"], DataPlaneError)(error["message"])

    def _wait_call(self, op: str, args: dict, timeout_s: float, done: Callable[[Any], bool]) -> Any:
        """A call the controller may hold until `done(result)` or the wait ends, in slices."""
        if not timeout_s >= 0:
            raise SchemaError(f"{op}: timeout must be seconds >= 0, got {timeout_s!r}")
        deadline = time.monotonic() + timeout_s
        while True:
            wait_s = max(0.0, min(self.config.wait_slice_s, deadline - time.monotonic()))
            result = self._call(op, {**args, "wait_s": wait_s}, timeout_s=wait_s + self.config.rpc_timeout_s)
            if done(result) or time.monotonic() >= deadline:
                return result

    # ---- tables -------------------------------------------------------------------------------
    def create_table(self, spec: TableSpec) -> TableSpec:
        """Create a table, or check that an existing one has exactly this schema (every rank may call it)."""
        if not isinstance(spec, TableSpec):
            raise SchemaError(f"create_table: expected a TableSpec, got {type(spec).__name__}")
        self._call("create_table", {"spec": spec.to_wire()})
        self._tables[spec.name] = spec
        return spec

    def table(self, name: str) -> TableSpec:
        spec = self._tables.get(name)
        if spec is None:
            spec = self._tables[name] = TableSpec.from_wire(self._call("get_table", {"table": name}))
        return spec

    def put(
        self,
        table: str,
        row_ids: Sequence[int],
        columns: Mapping[str, Any],
        group_ids: Sequence[int] | None = None,
        ack: "Batch | None" = None,
        ack_rows: Sequence[int] | None = None,
    ) -> AckResult | None:
        """Add new rows with some of their columns. Fails whole (nothing visible) on any conflict. With
        `ack`, also acks rows of that batch of the same table (`ack_rows`, or all of them) for its task,
        atomically: a consumer that turns the rows it leased into new rows never leaves both or neither."""
        if group_ids is not None and (
            len(group_ids) != len(row_ids)
            or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in group_ids)
        ):
            raise SchemaError(f"table '{table}': group_ids: expected {len(row_ids)} non-negative ints")
        ack_args = None
        if ack is not None:
            if ack.table != table:
                raise SchemaError(f"put: ack is a batch of table '{ack.table}', not '{table}'")
            acked = list(ack.row_ids if ack_rows is None else ack_rows)
            outside = sorted(set(acked) - set(ack.row_ids))
            if outside:
                raise SchemaError(f"put: ack_rows {outside[:5]} are not in the acked batch")
            ack_args = {"task": ack.task, "row_ids": acked}
        elif ack_rows is not None:
            raise SchemaError("put: ack_rows names rows of a batch; expected ack=the batch too")
        result = self._write(table, True, row_ids, columns, group_ids, ack_args)
        return AckResult(**result["ack"]) if ack is not None else None

    def add_columns(
        self,
        table: str,
        row_ids: Sequence[int],
        columns: Mapping[str, Any],
        ack: "Batch | None" = None,
    ) -> AckResult | None:
        """Add columns to existing rows; with `ack`, also ack these rows for that batch's task, atomically
        (the rows written must belong to the batch)."""
        ack_args = None
        if ack is not None:
            if ack.table != table:
                raise SchemaError(f"add_columns: ack is a batch of table '{ack.table}', not '{table}'")
            outside = sorted(set(row_ids) - set(ack.row_ids))
            if outside:
                raise SchemaError(f"add_columns: rows {outside[:5]} are not in the acked batch")
            ack_args = {"task": ack.task, "row_ids": list(row_ids)}
        result = self._write(table, False, row_ids, columns, None, ack_args)
        return AckResult(**result["ack"]) if ack is not None else None

    def _write(
        self,
        table: str,
        new: bool,
        row_ids: Sequence[int],
        columns: Mapping[str, Any],
        group_ids: Sequence[int] | None,
        ack: dict | None,
    ) -> dict:
        spec = self.table(table)
        spec.check_write(row_ids, columns)
        keys = self._take_keys(table, len(row_ids))
        args = {
            "table": table,
            "new": new,
            "row_ids": list(row_ids),
            "group_ids": list(group_ids) if group_ids is not None else None,
            "columns": list(columns),
            "keys": keys,
            "ack": ack,
            "consumer": self.consumer_id,
        }
        try:
            with self._using_sockets():
                self._storage().put(keys, {name: spec.column(name).to_storage(v) for name, v in columns.items()})
            return self._call("commit", args)
        except (SchemaError, RowConflictError):
            self._return_keys(table, keys)  # nothing references them; their storage is rewritten on reuse
            raise

    def _take_keys(self, table: str, n: int) -> list[int]:
        while True:
            with self._lock:
                free = self._free_keys.setdefault(table, [])
                if len(free) >= n:
                    keys, self._free_keys[table] = free[:n], free[n:]
                    return keys
                missing = n - len(free)
            # Never call the controller while holding the lock: a thread's first call takes it too.
            args = {"table": table, "n": max(missing, self.config.alloc_block), "units": self._write_units}
            allocated = self._call("alloc", args)
            self._return_keys(table, allocated)

    def _return_keys(self, table: str, keys: list[int]) -> None:
        with self._lock:
            self._free_keys.setdefault(table, []).extend(keys)

    def lease(
        self,
        table: str,
        task: str,
        columns: Sequence[str],
        count: int = 1,
        *,
        min_count: int | None = None,
        whole_groups: bool = False,
        group_range: tuple[int, int] | None = None,
        lease_s: float | None = None,
        timeout: float = 60.0,
    ) -> Batch | None:
        """Lease up to `count` rows (or whole groups) whose `columns` are all ready and that `task` has not
        consumed; waits until at least `min_count` (default: count) are ready, or returns None at timeout.
        group_range (with whole_groups): only groups with ids in [first, end), e.g. one batch's groups
        when batches must be consumed in the order they were written."""
        spec = self.table(table)
        columns = list(columns)
        if not columns:
            raise SchemaError(f"lease from table '{table}': expected at least one column")
        for c in columns:
            spec.column(c)
        lease_s = self.config.lease_s if lease_s is None else lease_s
        if not lease_s > 0:
            raise SchemaError(f"lease: lease_s must be seconds > 0, got {lease_s!r}")
        args = {
            "table": table,
            "task": task,
            "columns": columns,
            "whole_groups": whole_groups,
            "group_range": None if group_range is None else list(group_range),
            "count": count,
            "min_count": count if min_count is None else min_count,
            "lease_s": lease_s,
            "consumer": self.consumer_id,
        }
        leased = self._wait_call("lease", args, timeout, done=bool)
        if not leased:
            return None
        deadline = time.monotonic() + leased["deadline"]
        return Batch(
            table=table,
            task=task,
            lease_id=leased["lease_id"],
            deadline=deadline,
            row_ids=leased["row_ids"],
            group_ids=leased["group_ids"],
            columns=self._fetch(spec, leased["keys"]),
        )

    def _fetch(self, spec: TableSpec, keys: dict[str, list[int]]) -> dict[str, torch.Tensor | list]:
        """Columns written by one put share keys; each such set costs one storage round trip."""
        by_keys: dict[tuple[int, ...], list[str]] = {}
        for column, column_keys in keys.items():
            by_keys.setdefault(tuple(column_keys), []).append(column)
        out = {}
        for column_keys, names in by_keys.items():
            with self._using_sockets():
                values = self._storage().get(list(column_keys), names)
            for name in names:
                out[name] = spec.column(name).from_storage(values[name])
        return {c: out[c] for c in keys}

    def ack(self, batch: Batch, row_ids: Sequence[int] | None = None) -> AckResult:
        """Mark a batch's rows (or some of them, by id) done for its task. Idempotent."""
        rows = list(batch.row_ids) if row_ids is None else list(row_ids)
        if row_ids is not None:
            check_row_ids(rows, "ack row_ids")
        args = {"table": batch.table, "task": batch.task, "row_ids": rows, "consumer": self.consumer_id}
        return AckResult(**self._call("ack", args))

    def renew(self, batch: Batch, lease_s: float | None = None) -> list[int]:
        """Extend a batch's lease; returns the rows still held (LeaseLostError if none are)."""
        lease_s = self.config.lease_s if lease_s is None else lease_s
        args = {"table": batch.table, "lease_id": batch.lease_id, "consumer": self.consumer_id, "lease_s": lease_s}
        held = self._call("renew", args)
        batch.deadline = time.monotonic() + lease_s
        return held

    def release(self, batch: Batch) -> int:
        """Return a batch's unacked rows to its task's pool now, instead of at lease expiry."""
        args = {"table": batch.table, "lease_id": batch.lease_id, "consumer": self.consumer_id}
        return self._call("release", args)

    def release_consumer(self, table: str, consumer: str) -> int:
        """Return every lease another client (its `consumer_id`) holds on `table` to the pool now, instead of
        at their expiry: for a consumer known to be dead, such as a restarted process's predecessor. Returns
        how many units went back."""
        return self._call("release_consumer", {"table": table, "consumer": consumer})

    def written(self, table: str, row_ids: Sequence[int]) -> list[int]:
        """Which of `row_ids` were put and not dropped: held now, or consumed and retired since the data plane
        started (or was resumed). A producer started again skips them, so as not to write a row twice."""
        check_row_ids(list(row_ids), "written row_ids")
        return self._call("written", {"table": table, "row_ids": list(row_ids)})

    def peek(self, table: str, columns: Sequence[str]) -> Rows:
        """Every row of the table with `columns`, without leasing them: what a resumed run reads of the rows its
        data plane kept, to decide which it can use. Costs one storage read per set of rows written together."""
        spec = self.table(table)
        columns = list(columns)
        for c in columns:
            spec.column(c)
        found = self._call("peek", {"table": table, "columns": columns})
        values = {}
        for c, keys in found["keys"].items():
            have = [i for i, k in enumerate(keys) if k >= 0]
            column = [None] * len(keys)
            if have:
                fetched = self._fetch(spec, {c: [keys[i] for i in have]})[c]
                for i, value in zip(have, fetched, strict=True):
                    column[i] = value
            values[c] = column
        done = [set(tasks) for tasks in found["done"]]
        return Rows(table, found["row_ids"], found["group_ids"], done, values)

    def drop(self, table: str, row_ids: Sequence[int]) -> int:
        """End these rows' life now, whatever tasks consumed them (rows a resumed run cannot use); rows held by a
        lease are refused (SchemaError, nothing dropped). Returns how many storage keys that frees."""
        check_row_ids(list(row_ids), "drop row_ids")
        return self._call("drop", {"table": table, "row_ids": list(row_ids)})

    def table_stats(self, table: str) -> dict:
        return self._call("table_stats", {"table": table})

    def table_waiting(self, table: str) -> dict:
        """Per task: units ready, leases held (consumer, rows, seconds held), rows missing which columns."""
        return self._call("table_waiting", {"table": table})

    def rings_waiting(self) -> dict:
        """Per GPU token ring: its holder (None: nobody), the grant's number, seconds since the token last
        changed hands, and the members waiting for it, in order."""
        return self._call("rings_waiting", {})

    # ---- control streams ----------------------------------------------------------------------
    def append(self, stream: str, payload: Any) -> int:
        """Append one message (any msgpack-able value); returns its sequence number."""
        try:
            data = _payloads.encode(payload)
        except TypeError as e:
            raise SchemaError(f"stream '{stream}': payload is not msgpack-serialisable: {e}") from None
        return self._call("append", {"stream": stream, "payload": data})

    def reader(self, stream: str, name: str, start: int | str = START_LATEST) -> "StreamReader":
        """A named reader. start: a sequence number to replay from, "latest" (the newest message
        onward) or "resume" (where this reader name left off). A reader's position is saved each time
        it asks for more, so after a crash "resume" redelivers the last messages it was handed
        (at-least-once), and history is reclaimed only behind every reader's saved position."""
        return StreamReader(self, stream, name, start)

    def stream_stats(self, stream: str) -> dict:
        return self._call("stream_stats", {"stream": stream})

    def storage_bytes(self) -> dict[str, list[int]]:
        """Bytes this client has sent to and received from each storage unit (by position in
        `endpoints.storage`): writes are sent, reads received, with their requests and replies."""
        with self._lock:
            channels = list(self._storage_channels)
        units = range(len(self.endpoints.storage))
        return {
            "sent": [sum(c.sent[u] for c in channels) for u in units],
            "received": [sum(c.received[u] for c in channels) for u in units],
        }

    def close(self) -> None:
        """Give back unused storage keys and close every socket. Safe to call twice. A call another
        thread is waiting in ends with DataPlaneError (within _CANCEL_CHECK_S) before its socket closes;
        one that does not end within rpc_timeout_s keeps the sockets open (closing them under it could
        crash the process)."""
        if self._closed:
            return
        for table, keys in list(self._free_keys.items()):
            if keys:
                with contextlib.suppress(DataPlaneError):  # if the controller is gone, so are the keys
                    self._call("release_keys", {"table": table, "keys": keys})
        with self._uses:
            self._closing = True
            idle = self._uses.wait_for(lambda: self._in_use == 0, timeout=self.config.rpc_timeout_s)
        self._closed = True
        if not idle:
            log.warning("data-plane client %s: a call still uses its sockets; they stay open", self.consumer_id)
            return
        with self._lock:
            for channel in self._storage_channels:
                channel.close()
            for conn in self._connections:
                conn.close()
        self._ctx.term()

    def __enter__(self) -> "DataPlaneClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class StreamReader:
    """Reads one control stream in order, auditing sequence numbers: gaps (history reclaimed before it
    was read), duplicates and reordering are recorded in `audit`; duplicates are not delivered twice."""

    client: DataPlaneClient
    stream: str
    name: str
    start: int | str
    audit: SequenceAudit = field(default_factory=SequenceAudit)
    _next: int = 0

    def __post_init__(self) -> None:
        # Register now: from here on, history is kept for this reader until it has read it.
        args = {"stream": self.stream, "reader": self.name, "start": self.start, "max_n": 0, "wait_s": 0.0}
        self._next = self.client._call("read", args)["from"]
        self.audit.next_expected = self._next

    def read(self, max_n: int = 256, timeout: float = 0.0) -> list[StreamMessage]:
        args = {"stream": self.stream, "reader": self.name, "start": self._next, "max_n": max_n}
        result = self.client._wait_call("read", args, timeout, done=lambda r: bool(r["messages"]))
        out = []
        for seq, t, payload in result["messages"]:
            if self.audit.observe(seq) != DUPLICATE:
                out.append(StreamMessage(seq, t, _payload_decoder.decode(payload)))
            self._next = max(self._next, seq + 1)
        return out

    def close(self) -> None:
        """Stop pinning history: the controller forgets this reader's cursor."""
        self.client._call("close_reader", {"stream": self.stream, "reader": self.name})
