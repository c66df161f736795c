"""The controller's state machines, without sockets: tables and leases, streams, rings, audits."""

import itertools

import pytest

from meshy.dataplane import Column, LeaseLostError, RingError, RowConflictError, SchemaError, TableSpec
from meshy.dataplane.audit import DUPLICATE, GAP, OK, REORDERED, SequenceAudit
from meshy.dataplane.rings import FALLBACK, ON_DEMAND, RingState
from meshy.dataplane.row_ranges import RowRanges
from meshy.dataplane.streams import StreamState
from meshy.dataplane.tables import TableState

COLUMNS = (Column("prompt", "int64", (None,)), Column("response", "int64", (None,)), Column("reward", "float32"))


def table(group_size: int = 1, retire_after: tuple[str, ...] = ()) -> TableState:
    return TableState(TableSpec("t", COLUMNS, group_size=group_size, retire_after=retire_after))


def put(t: TableState, rows: list[int], columns: list[str], groups: list[int] | None = None, new: bool = True):
    t.check_commit(new, rows, groups, columns)
    t.commit(new, rows, groups, columns, [1000 + r for r in rows])


_lease_ids = itertools.count(1)


def lease(t: TableState, task: str, count: int, min_count: int = 1, now: float = 0.0, consumer: str = "c1"):
    return t.lease(task, consumer, count, min_count, lease_s=10.0, now=now, lease_id=next(_lease_ids))


def test_rows_reach_a_task_only_when_all_its_columns_are_ready_in_fifo_order():
    t = table()
    t.declare_task("train", ["prompt", "reward"], whole_groups=False)
    put(t, [0, 1, 2], ["prompt"])
    assert lease(t, "train", 3) is None
    put(t, [2, 0], ["reward"], new=False)
    got = lease(t, "train", 3)
    assert got.row_ids == [2, 0]
    assert got.keys == {"prompt": [1002, 1000], "reward": [1002, 1000]}
    assert lease(t, "train", 1) is None


def test_min_count_waits_for_enough_rows():
    t = table()
    t.declare_task("infer", ["prompt"], whole_groups=False)
    put(t, [0, 1], ["prompt"])
    assert lease(t, "infer", 4, min_count=3) is None
    assert lease(t, "infer", 4, min_count=2).row_ids == [0, 1]


def test_whole_groups_are_never_split():
    t = table(group_size=3)
    t.declare_task("train", ["reward"], whole_groups=True)
    put(t, [0, 1, 3, 4, 5], ["prompt", "reward"], groups=[7, 7, 8, 8, 8])
    got = lease(t, "train", 2)
    assert got.row_ids == [3, 4, 5] and got.group_ids == [8, 8, 8]
    assert lease(t, "train", 1) is None  # group 7 has 2 of its 3 rows
    put(t, [2], ["prompt", "reward"], groups=[7])
    assert lease(t, "train", 1).row_ids == [0, 1, 2]


def test_groups_need_every_member_ready():
    t = table(group_size=2)
    t.declare_task("train", ["reward"], whole_groups=True)
    put(t, [0, 1], ["prompt"], groups=[0, 0])
    put(t, [0], ["reward"], new=False)
    assert lease(t, "train", 1) is None
    put(t, [1], ["reward"], new=False)
    assert lease(t, "train", 1).row_ids == [0, 1]


def test_a_task_declared_late_sees_rows_already_there():
    t = table()
    put(t, [5, 6], ["prompt"])
    t.declare_task("late", ["prompt"], whole_groups=False)
    assert lease(t, "late", 5).row_ids == [5, 6]


def test_expired_leases_return_to_the_front_of_the_pool():
    t = table()
    t.declare_task("infer", ["prompt"], whole_groups=False)
    put(t, [0, 1, 2, 3], ["prompt"])
    assert lease(t, "infer", 2, now=0.0).row_ids == [0, 1]
    assert not t.expire(5.0)[0]
    assert t.expire(10.0)[0]
    assert lease(t, "infer", 4, now=11.0).row_ids == [0, 1, 2, 3]


def test_a_dead_consumer_s_leases_return_to_the_front_of_the_pool_at_once_and_no_one_else_s():
    t = table()
    t.declare_task("infer", ["prompt"], whole_groups=False)
    put(t, [0, 1, 2, 3, 4], ["prompt"])
    dead = [lease(t, "infer", 2, consumer="dead"), lease(t, "infer", 1, consumer="dead")]
    alive = lease(t, "infer", 1, consumer="alive")
    assert [d.row_ids for d in dead] + [alive.row_ids] == [[0, 1], [2], [3]]
    assert t.release_consumer("dead") == (3, [])  # nothing retires: the rows are still to be generated
    assert t.release_consumer("dead") == (0, [])
    assert list(t.leases) == [alive.lease_id]
    got = lease(t, "infer", 5, consumer="next", now=1.0)
    assert sorted(got.row_ids[:3]) == [0, 1, 2] and got.row_ids[3:] == [4]  # at the front, before row 4
    assert t.expire(10.0)[0] and sorted(t.tasks["infer"].ready) == [3]  # only the live lease was still due


def test_renewed_leases_do_not_expire_on_the_old_deadline():
    t = table()
    t.declare_task("infer", ["prompt"], whole_groups=False)
    put(t, [0], ["prompt"])
    got = lease(t, "infer", 1, now=0.0)
    assert t.renew(got.lease_id, "c1", 10.0, now=8.0) == [0]
    assert not t.expire(12.0)[0]
    assert t.expire(18.0)[0]
    with pytest.raises(LeaseLostError):
        t.renew(got.lease_id, "c1", 10.0, now=19.0)


def test_acks_are_idempotent_and_stale_acks_are_reported():
    t = table()
    t.declare_task("infer", ["prompt"], whole_groups=False)
    put(t, [0, 1], ["prompt"])
    first = lease(t, "infer", 2, now=0.0, consumer="slow")
    t.expire(20.0)
    lease(t, "infer", 2, now=21.0, consumer="fast")
    result, _ = t.ack("infer", [0], consumer="slow")  # the slow consumer finished after all
    assert result.stale == [0]
    result, _ = t.ack("infer", [0, 1], consumer="fast")
    assert result.already == [0] and result.acked == [1]
    assert lease(t, "infer", 2) is None
    assert first.row_ids == [0, 1]
    assert t.leases == {}


def test_partial_group_acks_are_refused():
    t = table(group_size=2)
    t.declare_task("train", ["prompt"], whole_groups=True)
    put(t, [0, 1], ["prompt"], groups=[0, 0])
    lease(t, "train", 1)
    with pytest.raises(SchemaError, match="ack all rows of group 0 together"):
        t.check_ack("train", [0])
    t.check_ack("train", [0, 1])


def test_rows_retire_once_every_retiring_task_acked_and_free_their_keys():
    t = table(retire_after=("train", "critic"))
    for task in ("train", "critic"):
        t.declare_task(task, ["prompt"], whole_groups=False)
    put(t, [0], ["prompt"])
    put(t, [0], ["reward"], new=False)
    lease(t, "train", 1)
    assert t.ack("train", [0], "c1")[1] == []
    _, freed = t.ack("critic", [0], "c1")
    assert freed == [1000]
    assert t.rows == {} and t.groups == {} and t.retired == 1
    result, freed = t.ack("critic", [0], "c1")
    assert result.unknown == [0] and freed == []


def test_rows_put_are_reported_written_while_held_and_once_consumed_but_not_once_dropped():
    """What a producer started again asks: rows consumed and retired count as written (it must not write them
    again); rows dropped (a resume that cannot use them) are free to be written again."""
    t = table(retire_after=("train",))
    t.declare_task("train", ["prompt"], whole_groups=False)
    put(t, [0, 1, 2, 3], ["prompt"])
    t.ack("train", [0, 1, 3], "c1")
    t.drop([2])
    assert t.rows.keys() == set() and t.written(range(6)) == [0, 1, 3]
    put(t, [2, 4], ["prompt"])
    assert t.written(range(6)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("order", [list(range(12)), list(range(11, -1, -1)), [5, 0, 9, 2, 7, 1, 11, 3, 8, 4, 10, 6]])
def test_row_ranges_hold_exactly_the_rows_added_in_as_few_ranges_as_they_make(order):
    ranges = RowRanges(max_ranges=12)
    for i, row in enumerate(order):
        ranges.add(row)
        ranges.add(row)  # twice changes nothing
        added = set(order[: i + 1])
        assert [r for r in range(-1, 14) if r in ranges] == sorted(added)
        runs = sum(1 for r in added if r - 1 not in added)
        assert len(ranges) == runs
    ranges.clear()
    assert len(ranges) == 0 and 0 not in ranges


def test_row_ranges_past_their_bound_hold_nothing_and_a_table_refuses_to_say_what_was_written():
    """Ids with gaps (a multi-turn run's turns) would make a range per row: the set gives up instead of growing."""
    ranges = RowRanges(max_ranges=3)
    for row in (0, 2, 4):
        ranges.add(row)
    assert len(ranges) == 3 and not ranges.overflowed
    ranges.add(1)  # joins two ranges into one
    ranges.add(9)
    assert len(ranges) == 3 and not ranges.overflowed
    ranges.add(11)
    assert ranges.overflowed and len(ranges) == 0 and 0 not in ranges
    ranges.clear()
    ranges.add(5)
    assert not ranges.overflowed and 5 in ranges
    t = table(retire_after=("train",))
    t.declare_task("train", ["prompt"], whole_groups=False)
    t.retired_rows.overflowed = True
    with pytest.raises(SchemaError, match="table 't': its retired row ids left over 65536 gaps"):
        t.written([0])


def test_a_row_leased_by_another_task_outlives_its_retiring_ack_until_that_lease_ends():
    t = table(retire_after=("train",))
    for task in ("train", "score"):
        t.declare_task(task, ["prompt"], whole_groups=False)
    put(t, [0, 1], ["prompt"])
    scoring = lease(t, "score", 2, now=0.0)
    lease(t, "train", 2, now=0.0)
    assert t.ack("train", [0, 1], "c1")[1] == [], "the scorer still holds both rows"
    put(t, [0, 1], ["reward"], new=False)  # the scorer can still write what it computed
    result, freed = t.ack("score", [0], "c1")
    assert result.acked == [0] and freed == [1000]
    changed, freed = t.expire(scoring.deadline)  # the scorer never acked row 1: its life ends with the lease
    assert changed and freed == [1001]
    assert t.rows == {} and t.retired == 2 and lease(t, "score", 2) is None
    assert t.tasks["score"].leased == {} and t.tasks["score"].ready == {}


def test_a_group_retires_when_its_last_row_is_acked_and_a_released_lease_frees_held_rows():
    t = table(group_size=2, retire_after=("train",))
    t.declare_task("train", ["prompt"], whole_groups=True)
    t.declare_task("score", ["prompt"], whole_groups=True)
    put(t, [0, 1, 2, 3], ["prompt"], groups=[0, 0, 1, 1])
    scoring = lease(t, "score", 1)
    assert scoring.row_ids == [0, 1]
    lease(t, "train", 2)
    _, freed = t.ack("train", [0, 1, 2, 3], "c1")
    assert freed == [1002, 1003], "group 1 was not held by the scorer"
    assert t.release(scoring.lease_id, "c1") == (1, [1000, 1001])
    assert t.rows == {} and t.groups == {} and t.tasks["score"].ready == {}


@pytest.mark.parametrize(
    ("first", "second", "error", "needle"),
    [
        (([0], None, True), ([1, 0], None, True), RowConflictError, "duplicate row id 0"),
        (([0], None, True), ([0], None, False), RowConflictError, "row 0 already has column 'prompt'"),
        (([0], None, True), ([9], None, False), RowConflictError, "no row 9 to add columns to"),
    ],
)
def test_conflicting_commits_change_nothing(first, second, error, needle):
    t = table()
    t.declare_task("infer", ["prompt"], whole_groups=False)
    put(t, first[0], ["prompt"], groups=first[1], new=first[2])
    before = (dict(t.rows), dict(t.tasks["infer"].ready))
    with pytest.raises(error, match=needle):
        t.check_commit(second[2], second[0], second[1], ["prompt"])
    assert (dict(t.rows), dict(t.tasks["infer"].ready)) == before


def test_groups_cannot_overflow_and_need_ids():
    t = table(group_size=2)
    with pytest.raises(SchemaError, match="one group id per row"):
        t.check_commit(True, [0], None, ["prompt"])
    put(t, [0, 1], ["prompt"], groups=[4, 4])
    with pytest.raises(RowConflictError, match="group 4 would have 3 rows"):
        t.check_commit(True, [2], [4], ["prompt"])


def test_a_task_keeps_its_declaration():
    t = table()
    t.declare_task("train", ["prompt"], whole_groups=False)
    with pytest.raises(SchemaError, match="task 'train' was declared with columns"):
        t.declare_task("train", ["prompt"], whole_groups=True)


# ---- streams ------------------------------------------------------------------------------------
def test_stream_readers_start_latest_replay_or_resume():
    s = StreamState("weights", retain=100)
    for v in range(3):
        s.append(b"%d" % v)
    assert s.resolve_start("a", "latest") == 3
    assert [m[0] for m in s.read("a", 1, 10)] == [1, 2, 3]
    assert s.resolve_start("a", "resume") == 1
    s.read("a", 4, 10)
    assert s.resolve_start("a", "resume") == 4
    with pytest.raises(SchemaError, match="start must be a sequence number"):
        s.resolve_start("a", 0)


def test_consumed_history_is_reclaimed_but_the_newest_message_stays():
    s = StreamState("weights", retain=1000)
    s.read("a", 1, 10)
    s.read("b", 1, 10)
    for _ in range(50):
        s.append(b"x")
    assert len(s.messages) == 50  # nobody has read past seq 1
    s.read("a", 51, 10)
    assert len(s.messages) == 50  # b still at 1
    s.read("b", 51, 10)
    assert [m[0] for m in s.messages] == [50]
    s.close_reader("a")
    s.close_reader("b")
    for _ in range(5000):
        s.append(b"x")
    assert len(s.messages) == 1000  # the hard cap


def test_a_reader_overtaken_by_reclamation_gets_later_messages():
    s = StreamState("run", retain=10)
    for _ in range(30):
        s.append(b"x")
    assert s.read("late", 1, 100)[0][0] == 21


# ---- rings --------------------------------------------------------------------------------------
def test_ring_starts_with_fallback_and_grants_in_request_order():
    r = RingState("r", [("train", ON_DEMAND), ("teach", ON_DEMAND), ("infer", FALLBACK)])
    first = r.start()
    assert (first.seq, first.holder) == (1, "infer")
    assert r.request("train") == (None, None)
    assert r.request("teach") == (None, None)
    assert r.request("train") == (None, None)  # idempotent
    g2 = r.release("infer", b"")
    assert (g2.seq, g2.holder, g2.previous) == (2, "train", "infer")
    g3 = r.release("train", b"v1")
    assert (g3.seq, g3.holder, g3.payload) == (3, "teach", b"v1")
    g4 = r.release("teach", b"v2")
    assert (g4.seq, g4.holder, g4.payload) == (4, "infer", b"v2")


def test_ring_without_fallback_parks_the_payload():
    r = RingState("r", [("a", ON_DEMAND), ("b", ON_DEMAND)])
    assert r.start() is None
    grant, new = r.request("a")
    assert grant is new and grant.seq == 1
    assert r.release("a", b"v7") is None and r.holder is None
    grant, _ = r.request("b")
    assert (grant.seq, grant.payload) == (2, b"v7")


def test_ring_rejects_strangers_and_false_releases():
    r = RingState("r", [("a", ON_DEMAND), ("b", FALLBACK)])
    r.start()
    with pytest.raises(RingError, match="'a' released the token, but 'b' holds it"):
        r.release("a", b"")
    with pytest.raises(SchemaError, match="'c' is not a member"):
        r.request("c")
    with pytest.raises(SchemaError, match="mode 'sometimes'"):
        RingState("x", [("a", "sometimes")])


# ---- audit --------------------------------------------------------------------------------------
def test_audit_classifies_gaps_duplicates_and_reordering():
    a = SequenceAudit()
    assert [a.observe(s) for s in (1, 2, 5, 3, 3, 6, 2, 4)] == [
        OK,
        OK,
        GAP,
        REORDERED,
        DUPLICATE,
        OK,
        DUPLICATE,
        REORDERED,
    ]
    assert a.gaps == [(3, 4)] and a.duplicates == [3, 2] and a.reordered == [3, 4]
    assert not a.clean
    clean = SequenceAudit()
    for s in range(1, 100):
        clean.observe(s)
    assert clean.clean and clean.next_expected == 100


def test_waiting_says_what_each_task_waits_for_and_who_holds_its_rows():
    t = table(group_size=2)
    t.declare_task("reward", ["response"], whole_groups=False)
    t.declare_task("train", ["response", "reward"], whole_groups=True)
    put(t, [0, 1, 2, 3], ["prompt"], groups=[0, 0, 1, 1])
    put(t, [0, 1, 2], ["response"], new=False)
    held = t.lease("reward", "judge0", 2, 1, lease_s=60.0, now=5.0, lease_id=next(_lease_ids))
    assert held.row_ids == [0, 1]
    put(t, [2], ["reward"], new=False)
    report = t.waiting(now=35.0)
    assert report["reward"] == {
        "columns": ["response"],
        "ready": 1,  # row 2 (its reward was written, but the task never acked it); row 3 has no response
        "leases": [{"consumer": "judge0", "rows": 2, "held_s": 30.0}],
        "missing": {"response": 1},
    }
    assert report["train"]["missing"] == {"reward": 2, "the rest of its group": 1, "response, reward": 1}
    assert report["train"]["ready"] == 0 and report["train"]["leases"] == []
