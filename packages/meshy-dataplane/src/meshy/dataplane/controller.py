"""The controller process: TransferQueue's controller, extended with Meshy's tables, leases, streams and rings.

TransferQueue's own request thread is replaced by one loop that serves both protocols on the same
socket: Meshy requests (magic first frame, msgpack) and TransferQueue requests (handed to the
controller's own handlers), so raw TransferQueue clients keep working. One thread owns all state, so
every operation is atomic. Waiting requests (lease, stream read, token) are parked and answered when
their condition holds or their deadline passes; nothing in the loop blocks.
"""

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from threading import Thread
from typing import Any

import msgspec
import zmq
from transfer_queue.controller import TransferQueueController
from transfer_queue.sampler import SequentialSampler
from transfer_queue.utils.perf_utils import IntervalPerfMonitor
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType, format_zmq_address

from meshy.dataplane.config import DataPlaneConfig
from meshy.dataplane.errors import DataPlaneError, SchemaError
from meshy.dataplane.journal import Journal
from meshy.dataplane.rings import RingState, ledger_stream
from meshy.dataplane.schema import TableSpec
from meshy.dataplane.security import Credentials
from meshy.dataplane.storage_io import STORAGE_IDENTITY_PREFIX
from meshy.dataplane.streams import StreamState
from meshy.dataplane.tables import TableState
from meshy.dataplane.wire import MAGIC, decode_request, encode_error, encode_reply

log = logging.getLogger(__name__)

MAX_BATCH_ROWS = 1 << 20
# Retired rows' storage is freed in batches, so clears do not queue in front of every put and get.
CLEAR_BATCH_KEYS = 1024
CLEAR_DELAY_S = 0.05
MAX_WAKE_PASSES = 16
RESTORED_KEYS = "meshy/restored"  # index-manager partition of keys a journal left unused, cleared before reuse
_DEFERRED = object()
_packer = msgspec.msgpack.Encoder()


@dataclass(slots=True)
class _Waiter:
    identity: Any
    request_id: int
    key: tuple[str, str]
    deadline: float
    attempt: Callable[[], Any]  # returns the reply, or None while the condition does not hold
    on_timeout: Callable[[], Any]
    consumer: str | None = None  # who waits to lease rows (a lease request), for release_consumer


class _StorageClearer:
    """Frees storage keys of retired rows, in batches; a key returns to the allocator only after its
    unit confirms, so a late clear can never hit data written under a reused key."""

    def __init__(self, ctx: zmq.Context, units: list[dict], creds: Credentials):
        self.sockets = []
        self.pending: list[deque[tuple[str, list[int]]]] = []
        for i, unit in enumerate(units):
            sock = ctx.socket(zmq.DEALER)
            sock.identity = f"{STORAGE_IDENTITY_PREFIX}controller_{i}".encode()
            sock.sndhwm = 10_000
            creds.secure_client(sock)
            sock.connect(format_zmq_address(unit["ip"], unit["ports"]["put_get_socket"]))
            self.sockets.append(sock)
            self.pending.append(deque())
        self.unit_ids = [u["id"] for u in units]
        self._queued: dict[str, list[int]] = {}
        self._queued_count = 0
        self.due: float | None = None  # when the oldest queued key must be sent

    def queue(self, table: str, keys: list[int], now: float) -> None:
        self._queued.setdefault(table, []).extend(keys)
        self._queued_count += len(keys)
        if self.due is None:
            self.due = now + CLEAR_DELAY_S

    def flush(self, now: float) -> None:
        if self.due is None or (now < self.due and self._queued_count < CLEAR_BATCH_KEYS):
            return
        for table, keys in self._queued.items():
            self._send(table, keys)
        self._queued, self._queued_count, self.due = {}, 0, None

    def _send(self, table: str, keys: list[int]) -> None:
        n = len(self.sockets)
        for u in range(n):
            mine = [k for k in keys if k % n == u]
            if not mine:
                continue
            msg = ZMQMessage.create(
                request_type=ZMQRequestType.CLEAR_DATA,
                sender_id="meshy_controller",
                receiver_id=self.unit_ids[u],
                body={"global_indexes": mine},
            )
            try:
                self.sockets[u].send_multipart(msg.serialize(), zmq.NOBLOCK)
            except zmq.Again:
                log.error("storage unit %s is not accepting clears; %d keys leak", self.unit_ids[u], len(mine))
                continue
            self.pending[u].append((table, mine))

    def drain(self, events: dict, release: Callable[[str, list[int]], None]) -> None:
        for u, sock in enumerate(self.sockets):
            if sock not in events:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                table, keys = self.pending[u].popleft()
                reply = ZMQMessage.deserialize(frames)
                if reply.request_type == ZMQRequestType.CLEAR_DATA_RESPONSE:
                    release(table, keys)
                else:
                    log.error("storage unit %s failed to clear %d keys: %s", self.unit_ids[u], len(keys), reply.body)


class MeshyController(TransferQueueController.__ray_actor_class__):  # the class under Ray's decorator
    def __init__(self, storage_units: list[dict], creds: Credentials, config: DataPlaneConfig):
        # Set before the base class starts the request thread (it calls _start_process_request).
        self._config = config
        self._creds = creds
        self._storage_units = storage_units
        self._tables: dict[str, TableState] = {}
        self._streams: dict[str, StreamState] = {}
        self._rings: dict[str, RingState] = {}
        self._waiters: list[_Waiter] = []
        self._dirty: set[tuple[str, str]] = set()
        self._lease_ids = itertools.count(1)
        self._spare_keys: dict[str, list[list[int]]] = {}  # table -> per storage unit, keys allocated, unused
        self._journal: Journal | None = None
        self._high_water = 0  # storage keys below it were handed out (journaled)
        self._unused_keys: list[int] = []  # restored: keys handed out before but holding no row's column
        self.restored: dict | None = None
        self._ops: dict[str, Callable[[dict, Any, int], Any]] = {
            name.removeprefix("_op_"): getattr(self, name) for name in dir(self) if name.startswith("_op_")
        }
        super().__init__(sampler=SequentialSampler, polling_mode=True)

    # ---- the loop -----------------------------------------------------------------------------
    def _start_process_request(self) -> None:
        if self._config.keeps_rows:
            self._restore()
        self.process_request_thread = Thread(target=self._serve, name="MeshyControllerLoop", daemon=True)
        self.process_request_thread.start()

    def _serve(self) -> None:
        sock = self.request_handle_socket
        self._clearer = _StorageClearer(self.zmq_context, self._storage_units, self._creds)
        if self._unused_keys:
            self._clearer.queue(RESTORED_KEYS, self._unused_keys, time.monotonic())
        self._perf = IntervalPerfMonitor(caller_name=self.controller_id)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        for s in self._clearer.sockets:
            poller.register(s, zmq.POLLIN)
        while True:
            events = dict(poller.poll(self._poll_timeout_ms()))
            if sock in events:
                for _ in range(256):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._dispatch(sock, frames)
            self._clearer.drain(events, self.index_manager.release_indexes)
            self._tick(sock, time.monotonic())

    def _poll_timeout_ms(self) -> int:
        deadlines = [w.deadline for w in self._waiters]
        deadlines += [d for t in self._tables.values() if (d := t.next_deadline()) is not None]
        if self._clearer.due is not None:
            deadlines.append(self._clearer.due)
        if not deadlines:
            return 1000
        return max(0, min(1000, int((min(deadlines) - time.monotonic()) * 1000) + 1))

    def _tick(self, sock: zmq.Socket, now: float) -> None:
        self._clearer.flush(now)
        if self._journal is not None:
            self._journal.compact_if_due(self._tables, self._high_water)
        for name, table in self._tables.items():
            changed, freed = table.expire(now)
            if changed:
                self._dirty.add(("table", name))
            self._free(name, freed)
        if not self._waiters:
            self._dirty.clear()
            return
        # Answering one waiter can change state another waits on (a ring grant appends to a ledger).
        # Attempts mark state dirty only when they change it, so this settles within a few passes.
        for _ in range(MAX_WAKE_PASSES):
            dirty, self._dirty = self._dirty, set()
            remaining = []
            for w in self._waiters:
                result = None
                try:
                    if w.key in dirty:
                        result = w.attempt()
                    if result is None and now >= w.deadline:
                        result = w.on_timeout()
                except DataPlaneError as e:
                    sock.send_multipart([w.identity, encode_error(w.request_id, type(e).__name__, str(e))])
                    continue
                if result is None:
                    remaining.append(w)
                else:
                    sock.send_multipart([w.identity, encode_reply(w.request_id, result)])
            self._waiters = remaining
            if not self._dirty:
                return
        log.error("waiters did not settle after %d passes; still dirty: %s", MAX_WAKE_PASSES, self._dirty)
        self._dirty.clear()

    def _dispatch(self, sock: zmq.Socket, frames: list) -> None:
        identity = frames[0]
        if len(frames) == 3 and frames[1].bytes == MAGIC:
            self._handle_meshy(sock, identity, frames[2])
        else:
            self._handle_transfer_queue(sock, identity, frames[1:])

    def _handle_meshy(self, sock: zmq.Socket, identity: Any, frame: Any) -> None:
        try:
            op, request_id, args = decode_request(frame.buffer)
        except Exception as e:
            sock.send_multipart([identity, encode_error(-1, "DataPlaneError", f"undecodable request: {e}")])
            return
        handler = self._ops.get(op)
        try:
            if handler is None:
                raise DataPlaneError(f"unknown operation {op!r}")
            result = handler(args, identity, request_id)
        except DataPlaneError as e:
            sock.send_multipart([identity, encode_error(request_id, type(e).__name__, str(e))])
        except Exception as e:
            log.exception("operation %s failed", op)
            sock.send_multipart(
                [identity, encode_error(request_id, "DataPlaneError", f"{op}: {type(e).__name__}: {e}")]
            )
        else:
            if result is not _DEFERRED:
                sock.send_multipart([identity, encode_reply(request_id, result)])

    def _handle_transfer_queue(self, sock: zmq.Socket, identity: Any, frames: list) -> None:
        try:
            request = ZMQMessage.deserialize(frames)
        except Exception as e:
            reply = self._make_error_response(None, f"undecodable request: {type(e).__name__}: {e}")
        else:
            try:
                reply = self._handle_request(request, self._perf) or self._make_error_response(
                    request.sender_id, f"no handler for request_type {request.request_type}"
                )
            except Exception as e:
                reply = self._make_error_response(
                    request.sender_id, f"{request.request_type} failed: {type(e).__name__}: {e}"
                )
        sock.send_multipart([identity, *reply.serialize()])

    def _wait(
        self,
        identity: Any,
        request_id: int,
        key: tuple[str, str],
        wait_s: float,
        attempt: Callable[[], Any],
        on_timeout: Callable[[], Any],
        consumer: str | None = None,
    ) -> Any:
        """Answer now if the condition holds or the caller won't wait; otherwise park the request."""
        result = attempt()
        if result is not None:
            return result
        if wait_s <= 0:
            return on_timeout()
        deadline = time.monotonic() + wait_s
        self._waiters.append(_Waiter(identity, request_id, key, deadline, attempt, on_timeout, consumer))
        return _DEFERRED

    # ---- durable rows -------------------------------------------------------------------------
    def _restore(self) -> None:
        """Read the journal back (meshy.dataplane.journal): the tables as they were, their rows' storage
        keys taken, every other key handed out before cleared before it is used again."""
        directory = self._config.durable_dir
        self._journal, restored = Journal.open(directory, self._config.durable, self._config.durable_sync_s)
        manager = self.index_manager
        manager.global_index_counter = max(manager.global_index_counter, restored.high_water)
        live: set[int] = set()
        for name, table in restored.tables.items():
            table.retired_rows.clear()  # the resume decides which consumed rows are written again (trained after
            self._tables[name] = table  # its checkpoint), so the ids of rows retired before are free again
            self.create_partition(name)
            keys = {k for row in table.rows.values() for k in row.keys.values()}
            manager.partition_to_indexes[name].update(keys)
            live |= keys
        self._unused_keys = [k for k in range(restored.high_water) if k not in live]
        manager.partition_to_indexes[RESTORED_KEYS].update(self._unused_keys)
        manager.allocated_indexes.update(live, self._unused_keys)
        self._note_high_water()
        rows = {name: len(t.rows) for name, t in restored.tables.items()}
        self.restored = {"rows": rows, "torn_bytes": restored.torn_bytes, "log_bytes": self._journal.size}

    def _note_high_water(self) -> None:
        counter = self.index_manager.global_index_counter
        if self._journal is not None and counter > self._high_water:
            self._journal.high_water(counter)
        self._high_water = max(self._high_water, counter)

    # ---- helpers ------------------------------------------------------------------------------
    def _table(self, name: Any) -> TableState:
        table = self._tables.get(name)
        if table is None:
            raise SchemaError(f"no table {name!r}; tables: {sorted(self._tables)}")
        return table

    def _stream(self, name: Any) -> StreamState:
        if not isinstance(name, str) or not name:
            raise SchemaError(f"stream name: expected a non-empty string, got {name!r}")
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = StreamState(name, self._config.stream_retain)
        return stream

    def _ring(self, name: Any) -> RingState:
        ring = self._rings.get(name)
        if ring is None:
            raise SchemaError(f"no ring {name!r}; rings: {sorted(self._rings)}")
        return ring

    def _free(self, table: str, keys: list[int]) -> None:
        if keys:
            self._clearer.queue(table, keys, time.monotonic())

    def _check_keys(self, table: str, keys: list[int]) -> None:
        owned = self.index_manager.partition_to_indexes.get(table, set())
        if not all(k in owned for k in keys):
            raise SchemaError(f"table '{table}': storage keys were not allocated for this table")

    def _record_grant(self, ring: RingState, grant: Any) -> None:
        if grant is not None:
            stream = ledger_stream(ring.name)
            self._stream(stream).append(_packer.encode(grant.to_wire()))
            self._dirty.add(("stream", stream))
            self._dirty.add(("ring", ring.name))

    # ---- operations: liveness and tables ------------------------------------------------------
    def _op_ping(self, args: dict, identity: Any, request_id: int) -> dict:
        return {"controller_id": self.controller_id}

    def _op_create_table(self, args: dict, identity: Any, request_id: int) -> dict:
        spec = TableSpec.from_wire(args["spec"])
        existing = self._tables.get(spec.name)
        if existing is not None:
            if existing.spec != spec:
                raise SchemaError(
                    f"table '{spec.name}' already exists with a different schema: {existing.spec} vs {spec}"
                )
        else:
            self._tables[spec.name] = TableState(spec)
            self.create_partition(spec.name)
            if self._journal is not None:
                self._journal.table(spec)
                self._note_high_water()
        return spec.to_wire()

    def _op_get_table(self, args: dict, identity: Any, request_id: int) -> dict:
        return self._table(args["table"]).spec.to_wire()

    def _op_alloc(self, args: dict, identity: Any, request_id: int) -> list[int]:
        """Storage keys for `n` rows of a table, stored on `units` (positions in the storage list; None:
        any). A key's unit is key % the number of units, so keys drawn for some units leave the others'
        aside, for whoever writes there next."""
        table = args["table"]
        self._table(table)
        n, count = args["n"], len(self._storage_units)
        if not isinstance(n, int) or not 1 <= n <= MAX_BATCH_ROWS:
            raise SchemaError(f"alloc: n must be an int in [1, {MAX_BATCH_ROWS}], got {n!r}")
        units = args.get("units")
        if units is None:
            units = list(range(count))
        if not units or not all(isinstance(u, int) and 0 <= u < count for u in units):
            raise SchemaError(f"alloc: units must name storage units in [0, {count}), got {units!r}")
        wanted = set(units)
        spare = self._spare_keys.setdefault(table, [[] for _ in range(count)])
        keys: list[int] = []
        for u in wanted:
            taken = spare[u][: n - len(keys)]
            del spare[u][: len(taken)]
            keys += taken
        while len(keys) < n:
            ask = -(-(n - len(keys)) * count // len(wanted))  # enough, were the keys fresh (spread evenly)
            for key in self.index_manager.allocate_indexes(table, ask):
                (keys if key % count in wanted and len(keys) < n else spare[key % count]).append(key)
        self._note_high_water()
        return keys

    def _op_release_keys(self, args: dict, identity: Any, request_id: int) -> None:
        self._check_keys(args["table"], args["keys"])
        self.index_manager.release_indexes(args["table"], args["keys"])

    def _op_commit(self, args: dict, identity: Any, request_id: int) -> dict:
        name = args["table"]
        table = self._table(name)
        row_ids, keys, ack = args["row_ids"], args["keys"], args.get("ack")
        if len(keys) != len(row_ids):
            raise SchemaError(f"table '{name}': {len(keys)} storage keys for {len(row_ids)} rows")
        self._check_keys(name, keys)
        table.check_commit(args["new"], row_ids, args.get("group_ids"), args["columns"])
        if ack is not None:
            table.check_ack(ack["task"], ack["row_ids"])
        if self._journal is not None:  # journaled first: a write that fails changes nothing
            self._journal.commit(name, args["new"], row_ids, args.get("group_ids"), args["columns"], keys)
            if ack is not None:
                self._journal.ack(name, ack["task"], ack["row_ids"])
        table.commit(args["new"], row_ids, args.get("group_ids"), args["columns"], keys)
        self._dirty.add(("table", name))
        if ack is None:
            return {}
        result, freed = table.ack(ack["task"], ack["row_ids"], args["consumer"])
        self._free(name, freed)
        return {"ack": asdict(result)}

    def _op_lease(self, args: dict, identity: Any, request_id: int) -> Any:
        name, task = args["table"], args["task"]
        table = self._table(name)
        count, min_count = args["count"], args["min_count"]
        if not isinstance(count, int) or not 1 <= count <= MAX_BATCH_ROWS:
            raise SchemaError(f"lease: count must be an int in [1, {MAX_BATCH_ROWS}], got {count!r}")
        if not isinstance(min_count, int) or not 1 <= min_count <= count:
            raise SchemaError(f"lease: min_count must be an int in [1, count={count}], got {min_count!r}")
        if not isinstance(task, str) or not task:
            raise SchemaError(f"lease: task must be a non-empty string, got {task!r}")
        groups = args.get("group_range")
        if groups is not None and not (
            args["whole_groups"]
            and isinstance(groups, list | tuple)
            and len(groups) == 2
            and all(isinstance(g, int) for g in groups)
            and groups[0] < groups[1]
        ):
            raise SchemaError(f"lease: group_range must be [first, end) of ints with whole_groups, got {groups!r}")
        if task not in table.tasks and self._journal is not None:
            table.declare_task(task, args["columns"], args["whole_groups"])
            self._journal.task(name, task, args["columns"], args["whole_groups"])
        table.declare_task(task, args["columns"], args["whole_groups"])

        def attempt() -> dict | None:
            now = time.monotonic()
            lease_id = next(self._lease_ids)
            leased = table.lease(task, args["consumer"], count, min_count, args["lease_s"], now, lease_id, groups)
            if leased is None:
                return None
            reply = asdict(leased)
            reply["deadline"] = leased.deadline - now  # relative: clocks differ between hosts
            return reply

        return self._wait(identity, request_id, ("table", name), args["wait_s"], attempt, lambda: {}, args["consumer"])

    def _op_ack(self, args: dict, identity: Any, request_id: int) -> dict:
        name = args["table"]
        table = self._table(name)
        table.check_ack(args["task"], args["row_ids"])
        if self._journal is not None:
            self._journal.ack(name, args["task"], args["row_ids"])
        result, freed = table.ack(args["task"], args["row_ids"], args["consumer"])
        self._free(name, freed)
        self._dirty.add(("table", name))
        return asdict(result)

    def _op_renew(self, args: dict, identity: Any, request_id: int) -> list[int]:
        return self._table(args["table"]).renew(args["lease_id"], args["consumer"], args["lease_s"], time.monotonic())

    def _op_release(self, args: dict, identity: Any, request_id: int) -> int:
        table = self._table(args["table"])
        released, freed = table.release(args["lease_id"], args["consumer"])
        self._free(table.spec.name, freed)
        self._dirty.add(("table", table.spec.name))
        return released

    def _op_release_consumer(self, args: dict, identity: Any, request_id: int) -> int:
        """A dead consumer's leases go back to the pool, and a lease request of its still parked here is answered
        empty now (rows that became ready would otherwise be leased to it, and wait out the lease)."""
        table = self._table(args["table"])
        parked = [w for w in self._waiters if w.consumer == args["consumer"] and w.key == ("table", table.spec.name)]
        for w in parked:
            self._waiters.remove(w)
            self.request_handle_socket.send_multipart([w.identity, encode_reply(w.request_id, w.on_timeout())])
        released, freed = table.release_consumer(args["consumer"])
        self._free(table.spec.name, freed)
        self._dirty.add(("table", table.spec.name))
        return released

    def _op_drop(self, args: dict, identity: Any, request_id: int) -> int:
        table = self._table(args["table"])
        row_ids = args["row_ids"]
        if not isinstance(row_ids, list) or not all(isinstance(r, int) for r in row_ids):
            raise SchemaError(f"drop: row_ids must be a list of ints, got {row_ids!r:.80}")
        table.check_drop(row_ids)
        if self._journal is not None:
            self._journal.drop(table.spec.name, row_ids)
        freed = table.drop(row_ids)
        self._free(table.spec.name, freed)
        self._dirty.add(("table", table.spec.name))
        return len(freed)

    def _op_written(self, args: dict, identity: Any, request_id: int) -> list[int]:
        return self._table(args["table"]).written(args["row_ids"])

    def _op_peek(self, args: dict, identity: Any, request_id: int) -> dict:
        table = self._table(args["table"])
        for c in args["columns"]:
            table.spec.column(c)
        rows = table.rows
        return {
            "row_ids": list(rows),
            "group_ids": [row.group for row in rows.values()],
            "done": [sorted(row.done) for row in rows.values()],
            "keys": {c: [row.keys.get(c, -1) for row in rows.values()] for c in args["columns"]},
        }

    def _op_table_stats(self, args: dict, identity: Any, request_id: int) -> dict:
        return self._table(args["table"]).stats()

    def _op_table_waiting(self, args: dict, identity: Any, request_id: int) -> dict:
        return self._table(args["table"]).waiting(time.monotonic())

    # ---- operations: control streams ----------------------------------------------------------
    def _op_append(self, args: dict, identity: Any, request_id: int) -> int:
        stream = self._stream(args["stream"])
        self._dirty.add(("stream", stream.name))
        return stream.append(args["payload"])

    def _op_read(self, args: dict, identity: Any, request_id: int) -> Any:
        stream = self._stream(args["stream"])
        reader = args["reader"]
        if not isinstance(reader, str) or not reader:
            raise SchemaError(f"stream '{stream.name}': reader must be a non-empty string, got {reader!r}")
        from_seq = stream.resolve_start(reader, args["start"])
        if not isinstance(args["max_n"], int) or args["max_n"] < 0:
            raise SchemaError(f"stream '{stream.name}': max_n must be an int >= 0, got {args['max_n']!r}")

        def attempt() -> dict | None:
            messages = stream.read(reader, from_seq, args["max_n"])
            return {"from": from_seq, "messages": messages} if messages else None

        return self._wait(
            identity,
            request_id,
            ("stream", stream.name),
            args["wait_s"],
            attempt,
            lambda: {"from": from_seq, "messages": []},
        )

    def _op_close_reader(self, args: dict, identity: Any, request_id: int) -> None:
        self._stream(args["stream"]).close_reader(args["reader"])

    def _op_stream_stats(self, args: dict, identity: Any, request_id: int) -> dict:
        return self._stream(args["stream"]).stats()

    # ---- operations: GPU token rings ----------------------------------------------------------
    def _op_rings_waiting(self, args: dict, identity: Any, request_id: int) -> dict:
        now = time.monotonic()
        return {name: ring.waiting(now) for name, ring in self._rings.items()}

    def _op_ring_declare(self, args: dict, identity: Any, request_id: int) -> dict:
        name = args["ring"]
        members = [(m, mode) for m, mode in args["members"]]
        ring = self._rings.get(name)
        if ring is None:
            ring = RingState(name, members)
            self._rings[name] = ring
            self._record_grant(ring, ring.start())
        elif ring.members != members:
            raise SchemaError(f"ring '{name}' already exists with members {ring.members}, not {members}")
        ring.check_member(args["member"])
        # The member's ledger reader is registered here, atomically, so no grant from now on is
        # reclaimed before the member has read it.
        ledger = self._stream(ledger_stream(name))
        ledger.cursors.setdefault(args["member"], max(1, ring.seq))
        return ring.status()

    def _op_ring_request(self, args: dict, identity: Any, request_id: int) -> Any:
        ring = self._ring(args["ring"])
        member = args["member"]
        ring.check_member(member)

        def attempt() -> dict | None:
            queued = member in ring.pending
            grant, new = ring.request(member)
            self._record_grant(ring, new)
            if not queued and member in ring.pending:
                self._dirty.add(("ring", ring.name))  # wakes the holder's status wait
            return grant.to_wire() if grant is not None else None

        return self._wait(identity, request_id, ("ring", ring.name), args["wait_s"], attempt, lambda: {})

    def _op_ring_cancel(self, args: dict, identity: Any, request_id: int) -> None:
        ring = self._ring(args["ring"])
        ring.check_member(args["member"])
        if args["member"] in ring.pending:
            ring.pending.remove(args["member"])

    def _op_ring_release(self, args: dict, identity: Any, request_id: int) -> dict | None:
        ring = self._ring(args["ring"])
        grant = ring.release(args["member"], args["payload"])
        self._record_grant(ring, grant)
        self._dirty.add(("ring", ring.name))
        return grant.to_wire() if grant is not None else None

    def _op_ring_status(self, args: dict, identity: Any, request_id: int) -> Any:
        ring = self._ring(args["ring"])
        member, known_seq = args["member"], args["known_seq"]
        ring.check_member(member)

        def attempt() -> dict | None:
            if ring.seq != known_seq or (ring.holder == member and ring.pending):
                return ring.status()
            return None

        return self._wait(identity, request_id, ("ring", ring.name), args["wait_s"], attempt, ring.status)
