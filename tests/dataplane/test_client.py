"""The client against real data-plane servers (one controller, two storage units)."""

import threading
import time
from functools import partial

import pytest
import torch

from meshy.dataplane import (
    HOST,
    Column,
    DataPlaneClient,
    DataPlaneError,
    LeaseLostError,
    RowConflictError,
    SchemaError,
    TableSpec,
)

ROLLOUT = (
    Column("prompt_ids", "int64", (None,)),
    Column("response_ids", "int64", (None,)),
    Column("logprobs", "float32", (16,)),
    Column("topk", "float32", (None, 4)),
    Column("reward", "float32"),
    Column("finish_reason", "str"),
)


def make_table(client, unique, group_size=1, retire_after=()):
    return client.create_table(TableSpec(unique("rollout"), ROLLOUT, group_size=group_size, retire_after=retire_after))


def test_columns_round_trip_dense_stays_dense_ragged_as_declared(client, unique):
    t = make_table(client, unique).name
    rows = list(range(10, 17))
    prompts = [torch.randint(0, 1000, (n + 1,)) for n in range(len(rows))]
    logprobs = torch.randn(len(rows), 16)
    client.put(t, rows, {"prompt_ids": prompts, "logprobs": logprobs})
    topk = [torch.randn(n, 4) for n in range(len(rows))]
    client.add_columns(t, rows, {"reward": torch.arange(7.0), "finish_reason": ["stop"] * 6 + ["length"], "topk": topk})

    batch = client.lease(t, "train", ["prompt_ids", "logprobs", "topk", "reward", "finish_reason"], count=7, timeout=5)
    assert batch.row_ids == rows
    assert isinstance(batch.columns["logprobs"], torch.Tensor) and not batch.columns["logprobs"].is_nested
    assert torch.equal(batch.columns["logprobs"], logprobs)
    assert torch.equal(batch.columns["reward"], torch.arange(7.0))
    assert all(torch.equal(a, b) for a, b in zip(batch.columns["prompt_ids"], prompts, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(batch.columns["topk"], topk, strict=True))
    assert batch.columns["finish_reason"][-1] == "length"


def test_rows_wait_until_every_needed_column_is_ready(client, unique):
    t = make_table(client, unique).name
    client.put(t, [0, 1], {"prompt_ids": [torch.arange(2), torch.arange(3)]})
    assert client.lease(t, "train", ["prompt_ids", "reward"], timeout=0.3) is None
    client.add_columns(t, [1], {"reward": torch.tensor([1.0])})
    batch = client.lease(t, "train", ["prompt_ids", "reward"], count=2, min_count=1, timeout=2)
    assert batch.row_ids == [1]


def test_a_waiting_lease_is_answered_as_soon_as_rows_arrive(client, unique, dataplane, secret):
    t = make_table(client, unique).name
    with DataPlaneClient(dataplane.endpoints, secret) as producer:
        import threading

        timer = threading.Timer(0.5, lambda: producer.put(t, [3], {"prompt_ids": [torch.arange(4)]}))
        timer.start()
        t0 = time.monotonic()
        batch = client.lease(t, "infer", ["prompt_ids"], timeout=10)
        waited = time.monotonic() - t0
        timer.join()
    assert batch.row_ids == [3]
    assert 0.4 < waited < 2.0


def test_whole_groups_only(client, unique):
    t = make_table(client, unique, group_size=4).name
    client.put(t, [0, 1, 2], {"reward": torch.zeros(3)}, group_ids=[0, 0, 0])
    client.put(t, [4, 5, 6, 7], {"reward": torch.ones(4)}, group_ids=[1, 1, 1, 1])
    batch = client.lease(t, "train", ["reward"], count=2, min_count=1, whole_groups=True, timeout=2)
    assert batch.row_ids == [4, 5, 6, 7] and batch.group_ids == [1, 1, 1, 1]
    assert client.lease(t, "train", ["reward"], whole_groups=True, timeout=0.3) is None
    client.put(t, [3], {"reward": torch.zeros(1)}, group_ids=[0])
    batch = client.lease(t, "train", ["reward"], whole_groups=True, timeout=2)
    assert batch.row_ids == [0, 1, 2, 3]
    with pytest.raises(SchemaError, match="ack all rows of group 0 together"):
        client.ack(batch, row_ids=[0, 1])
    assert client.ack(batch).acked == [0, 1, 2, 3]


def test_a_group_range_leases_only_its_groups_even_when_later_ones_are_ready_first(client, unique):
    """How a trainer takes the batches of bounded pacing in order: batch 1's groups (2, 3) are ready
    before batch 0's (0, 1), and a lease for batch 0 waits for batch 0."""
    t = make_table(client, unique, group_size=2).name
    client.put(t, [4, 5, 6, 7], {"reward": torch.ones(4)}, group_ids=[2, 2, 3, 3])
    client.put(t, [0, 1, 2], {"reward": torch.zeros(3)}, group_ids=[0, 0, 1])
    lease = partial(client.lease, t, "train", ["reward"], count=2, whole_groups=True)
    assert lease(group_range=(0, 2), timeout=0.3) is None
    assert lease(group_range=(0, 2), min_count=1, timeout=2).group_ids == [0, 0]
    client.put(t, [3], {"reward": torch.zeros(1)}, group_ids=[1])
    assert lease(group_range=(0, 2), min_count=1, timeout=2).group_ids == [1, 1]
    assert lease(group_range=(2, 4), timeout=2).group_ids == [2, 2, 3, 3]
    for bad in ((2, 2), (0,), ("0", 2)):
        with pytest.raises(SchemaError, match="group_range"):
            lease(group_range=bad, timeout=0.3)
    with pytest.raises(SchemaError, match="group_range.*whole_groups"):
        client.lease(t, "other", ["reward"], group_range=(0, 2), timeout=0.3)


def test_a_conflicting_put_writes_nothing(client, unique):
    t = make_table(client, unique).name
    client.put(t, [1], {"reward": torch.zeros(1)})
    with pytest.raises(RowConflictError, match="duplicate row id 1"):
        client.put(t, [0, 1, 2], {"reward": torch.ones(3)})
    assert client.table_stats(t)["rows"] == 1
    batch = client.lease(t, "train", ["reward"], count=3, min_count=1, timeout=2)
    assert batch.row_ids == [1] and batch.columns["reward"].tolist() == [0.0]
    with pytest.raises(RowConflictError, match="row 1 already has column 'reward'"):
        client.add_columns(t, [1], {"reward": torch.ones(1)})
    with pytest.raises(RowConflictError, match="no row 5 to add columns to"):
        client.add_columns(t, [5], {"reward": torch.ones(1)})


def test_bad_input_is_refused_before_anything_is_sent(client, unique):
    t = make_table(client, unique).name
    with pytest.raises(SchemaError, match="table '.*' has no column 'rewards'"):
        client.put(t, [0], {"rewards": torch.zeros(1)})
    with pytest.raises(SchemaError, match="column 'logprobs': expected a float32 tensor of shape \\(1, 16\\)"):
        client.put(t, [0], {"logprobs": torch.zeros(1, 15)})
    with pytest.raises(SchemaError, match="group_ids given, but group_size is 1"):
        client.put(t, [0], {"reward": torch.zeros(1)}, group_ids=[0])
    with pytest.raises(SchemaError, match="no table 'nope'"):
        client.put("nope", [0], {"reward": torch.zeros(1)})
    assert client.table_stats(t)["rows"] == 0


def test_unacked_rows_return_to_the_pool_and_acks_are_idempotent(client, unique, dataplane, secret):
    t = make_table(client, unique).name
    client.put(t, [0, 1, 2], {"reward": torch.zeros(3)})
    first = client.lease(t, "train", ["reward"], count=2, lease_s=0.5, timeout=2)
    assert first.row_ids == [0, 1]
    with DataPlaneClient(dataplane.endpoints, secret) as other:
        second = other.lease(t, "train", ["reward"], count=3, timeout=3)
        assert second.row_ids == [2] or sorted(second.row_ids) == [0, 1, 2]
        rest = [] if len(second) == 3 else other.lease(t, "train", ["reward"], count=2, timeout=3).row_ids
        assert sorted(second.row_ids + rest) == [0, 1, 2]
        assert other.ack(second).acked == second.row_ids
    late = client.ack(first)
    assert late.acked == [] and sorted(late.already + late.stale) == [0, 1]
    with pytest.raises(LeaseLostError):
        client.renew(first)


def test_renewing_keeps_rows_past_their_first_deadline(client, unique):
    t = make_table(client, unique).name
    client.put(t, [0], {"reward": torch.zeros(1)})
    batch = client.lease(t, "train", ["reward"], lease_s=0.6, timeout=2)
    for _ in range(3):
        time.sleep(0.3)
        assert client.renew(batch, lease_s=0.6) == [0]
    assert client.lease(t, "train", ["reward"], timeout=0.2) is None
    assert client.ack(batch).acked == [0]


def test_retired_rows_free_their_storage(client, unique):
    t = make_table(client, unique, retire_after=("train",)).name
    client.put(t, [0, 1], {"reward": torch.zeros(2), "finish_reason": ["a", "b"]})
    raw = client._call(
        "lease",
        {
            "table": t,
            "task": "train",
            "columns": ["reward"],
            "whole_groups": False,
            "count": 2,
            "min_count": 2,
            "lease_s": 10.0,
            "consumer": client.consumer_id,
            "wait_s": 1.0,
        },
    )
    keys = raw["keys"]["reward"]
    assert client._storage().get(keys, ["reward", "finish_reason"])["finish_reason"] == ["a", "b"]
    client._call("ack", {"table": t, "task": "train", "row_ids": [0, 1], "consumer": client.consumer_id})
    assert client.table_stats(t)["retired"] == 2
    deadline = time.monotonic() + 3
    while True:
        try:
            client._storage().get(keys, ["reward"])
        except DataPlaneError as e:
            assert "not found" in str(e)
            break
        assert time.monotonic() < deadline, "retired rows still in storage"
        time.sleep(0.05)


def test_add_columns_with_ack_is_atomic(client, unique):
    t = make_table(client, unique).name
    client.put(t, [0, 1], {"prompt_ids": [torch.arange(2), torch.arange(2)]})
    batch = client.lease(t, "infer", ["prompt_ids"], count=2, timeout=2)
    with pytest.raises(SchemaError, match="expected a list of tensors"):
        client.add_columns(t, batch.row_ids, {"response_ids": torch.zeros(2, 3, dtype=torch.int64)}, ack=batch)
    assert client.table_stats(t)["tasks"]["infer"] == {"ready": 0, "leased": 2, "done": 0}
    result = client.add_columns(t, batch.row_ids, {"response_ids": [torch.arange(3)] * 2}, ack=batch)
    assert result.acked == [0, 1]
    assert client.table_stats(t)["tasks"]["infer"] == {"ready": 0, "leased": 0, "done": 2}


def test_put_with_ack_adds_the_new_rows_and_acks_the_leased_ones_together(client, unique):
    t = make_table(client, unique).name
    client.put(t, [0, 1], {"prompt_ids": [torch.arange(2, device=HOST)] * 2})
    batch = client.lease(t, "step", ["prompt_ids"], count=2, timeout=2)
    with pytest.raises(SchemaError, match=r"ack_rows \[7\] are not in the acked batch"):
        client.put(t, [10], {"prompt_ids": [torch.arange(3, device=HOST)]}, ack=batch, ack_rows=[7])
    with pytest.raises(RowConflictError, match="duplicate row id 1"):  # fails whole: row 0's ack is not kept
        client.put(t, [1], {"prompt_ids": [torch.arange(3, device=HOST)]}, ack=batch, ack_rows=[0])
    assert client.table_stats(t)["tasks"]["step"] == {"ready": 0, "leased": 2, "done": 0}
    result = client.put(t, [10], {"prompt_ids": [torch.arange(3, device=HOST)]}, ack=batch, ack_rows=[0])
    assert result.acked == [0]
    assert client.table_stats(t)["tasks"]["step"] == {"ready": 1, "leased": 1, "done": 1}  # row 10 is new


def test_tables_are_declared_idempotently(client, unique):
    spec = TableSpec(unique("t"), ROLLOUT)
    client.create_table(spec)
    client.create_table(spec)
    with pytest.raises(SchemaError, match="already exists with a different schema"):
        client.create_table(TableSpec(spec.name, ROLLOUT[:2]))


def test_lease_timeout_returns_none_on_time(client, unique):
    t = make_table(client, unique).name
    t0 = time.monotonic()
    assert client.lease(t, "train", ["reward"], timeout=1.5) is None
    assert 1.4 < time.monotonic() - t0 < 3.0


# ---- control streams ----------------------------------------------------------------------------
def test_streams_replay_latest_and_resume(client, unique):
    s = unique("weights")
    for v in range(1, 4):
        assert client.append(s, {"version": v}) == v
    replay = client.reader(s, "replay", start=1)
    assert [m.payload["version"] for m in replay.read()] == [1, 2, 3]
    latest = client.reader(s, "latest")
    assert [m.seq for m in latest.read()] == [3]
    client.append(s, {"version": 4})
    assert [m.payload for m in latest.read(timeout=1)] == [{"version": 4}]
    assert [m.seq for m in replay.read()] == [4]
    # A position is saved when the reader asks for more: resuming redelivers what was handed out last.
    resumed = client.reader(s, "replay", start="resume")
    assert [m.seq for m in resumed.read()] == [4]
    assert replay.audit.clean and latest.audit.clean


def test_stream_reader_waits_for_the_next_message(client, unique, dataplane, secret):
    s = unique("run")
    reader = client.reader(s, "r")
    assert reader.read(timeout=0.2) == []
    with DataPlaneClient(dataplane.endpoints, secret) as other:
        timer = threading.Timer(0.3, lambda: other.append(s, "go"))
        timer.start()
        got = reader.read(timeout=5)
        timer.join(timeout=30)  # the reader may get the message before append has its reply: close after it
    assert [m.payload for m in got] == ["go"]


def test_a_reader_that_falls_behind_the_retention_cap_reports_the_gap(client, unique):
    s = unique("log")
    cap = client.stream_stats(s)  # created empty
    assert cap["retained"] == 0
    for i in range(1100):  # the shared server keeps at most 1024 (DataPlaneConfig.stream_retain)
        client.append(s, i)
    reader = client.reader(s, "late", start=1)
    first = reader.read(max_n=10)
    assert first[0].seq == 77
    assert reader.audit.gaps == [(1, 76)]


def test_100k_messages_leave_the_stream_bounded(client, unique, dataplane):
    import psutil

    s = unique("weights")
    controller = psutil.Process(dataplane.pids["controller"])
    reader = client.reader(s, "follower", start=1)
    rss_before = None
    for i in range(100_000):
        client.append(s, {"version": i, "path": f"/runs/x/weights/v{i:06d}"})
        if i % 1000 == 999:
            for _ in range(10):
                assert len(reader.read(max_n=100)) == 100
            # Only the last batch handed out stays (until the reader asks for more): far below the
            # 1024-message cap, so this is reclamation behind the reader, not the cap.
            assert client.stream_stats(s)["retained"] <= 100
        if i == 10_000:
            rss_before = controller.memory_info().rss
    assert reader.audit.clean and reader.audit.received == 100_000
    assert controller.memory_info().rss - rss_before < 16 << 20


def test_payloads_must_be_serialisable(client, unique):
    with pytest.raises(SchemaError, match="payload is not msgpack-serialisable"):
        client.append(unique("s"), object())


def test_a_new_thread_whose_first_call_allocates_storage_keys_does_not_deadlock(client, unique):
    import threading

    t = make_table(client, unique).name
    errors = []

    def put(base: int) -> None:
        try:  # a fresh thread: no socket yet, and more rows than the client's free keys
            client.put(t, list(range(base, base + 300)), {"reward": torch.zeros(300)})
        except Exception as e:
            errors.append(e)

    workers = [threading.Thread(target=put, args=(i * 1000,)) for i in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=20)
    assert not any(worker.is_alive() for worker in workers), "a put deadlocked"
    assert errors == [] and client.table_stats(t)["rows"] == 900


def test_closing_a_client_ends_the_wait_another_thread_is_in_before_closing_its_socket(dataplane, secret, unique):
    """A trainer's prefetch thread can be waiting in a lease when its process closes the client: the wait
    ends with an error saying so, and close() closes no socket under it (a ZMQ socket closed under a
    thread that uses it can crash the process)."""
    closing = DataPlaneClient(dataplane.endpoints, secret, name="closing")
    table = make_table(closing, unique).name
    errors = []

    def wait_for_rows() -> None:
        try:
            closing.lease(table, "never-ready", ["prompt_ids"], timeout=30)
        except DataPlaneError as e:
            errors.append(str(e))

    waiter = threading.Thread(target=wait_for_rows)
    waiter.start()
    time.sleep(0.5)  # inside its lease by now
    start = time.monotonic()
    closing.close()
    waiter.join(10)
    assert not waiter.is_alive() and time.monotonic() - start < 5
    assert errors == ["the client was closed while 'lease' waited for the data-plane controller"]
    with pytest.raises(DataPlaneError, match="the client is closed"):
        closing.table_stats(table)
