"""Multi-process behaviour with real processes sharing one data plane."""

import itertools
import json
import os
import signal
import time

import pytest
import torch

from meshy.dataplane import FALLBACK, ON_DEMAND, Column, TableSpec
from tests.dataplane import workers


def wait_for(path, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    time.sleep(0.05)
    return json.loads(path.read_text())


def test_rows_held_by_a_killed_consumer_are_processed_exactly_once(
    client, unique, dataplane, secret, mp_context, tmp_path
):
    table = client.create_table(TableSpec(unique("work"), (Column("x", "int64"),))).name
    rows = list(range(40))
    client.put(table, rows, {"x": torch.tensor(rows)})
    endpoints = dataplane.endpoints.to_json()

    victim = mp_context.Process(
        target=workers.ack_then_hold, args=(endpoints, secret, table, "work", 5, 10, str(tmp_path / "victim.json"))
    )
    victim.start()
    before = wait_for(tmp_path / "victim.json")
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()
    assert len(before["acked"]) == 5 and len(before["held"]) == 10

    survivor = mp_context.Process(
        target=workers.drain, args=(endpoints, secret, table, "work", 40, str(tmp_path / "survivor.json"))
    )
    survivor.start()
    survivor.join(90)
    after = json.loads((tmp_path / "survivor.json").read_text())

    assert set(before["held"]) <= set(after["received"]), "rows held by the killed consumer were lost"
    tally = before["acked"] + after["acked"]
    assert sorted(tally) == rows, "every row processed exactly once"
    assert client.table_stats(table)["tasks"]["work"] == {"ready": 0, "leased": 0, "done": 40}


def test_a_dead_consumer_released_leases_nothing_later_from_a_request_it_left_waiting(
    client, unique, dataplane, secret, mp_context, tmp_path
):
    """A consumer killed while its lease request waits for rows: once released, the rows that then become ready
    go to a live consumer, not to the dead one's parked request (where they would wait out a lease)."""
    table = client.create_table(TableSpec(unique("work"), (Column("x", "int64"),))).name
    waiting = mp_context.Process(
        target=workers.wait_to_lease, args=(dataplane.endpoints.to_json(), secret, table, "work", str(tmp_path / "id"))
    )
    waiting.start()
    while not (tmp_path / "id").exists() or not (tmp_path / "id").read_text():
        time.sleep(0.05)
    time.sleep(0.5)  # its request is parked
    os.kill(waiting.pid, signal.SIGKILL)
    waiting.join()
    assert client.release_consumer(table, (tmp_path / "id").read_text()) == 0
    client.put(table, [0], {"x": torch.tensor([7])})
    batch = client.lease(table, "work", ["x"], timeout=5)
    assert batch is not None and batch.row_ids == [0]


@pytest.mark.parametrize(
    "members",
    [
        [("trainer", ON_DEMAND), ("inference", FALLBACK)],
        [("trainer", ON_DEMAND), ("teacher", ON_DEMAND), ("inference", FALLBACK)],
    ],
    ids=["2-members", "3-members"],
)
def test_gpu_token_ring_with_real_processes(members, client, unique, dataplane, secret, mp_context, tmp_path):
    ring = unique("ring")
    cycles = 15
    stop = tmp_path / "stop"
    procs = {}
    for member, _ in reversed(members):  # the FALLBACK member starts first and holds the token
        args = (dataplane.endpoints.to_json(), secret, ring, member, members, cycles, str(tmp_path / member), str(stop))
        procs[member] = mp_context.Process(target=workers.ring_member, args=args)
        procs[member].start()
    for member, mode in members:
        if mode == ON_DEMAND:
            procs[member].join(120)
            assert procs[member].exitcode == 0, f"{member} failed"
    stop.touch()
    for proc in procs.values():
        proc.join(60)
        assert proc.exitcode == 0
    logs = {m: json.loads((tmp_path / m).read_text()) for m, _ in members}

    acquires = sorted((e[1], m, e[2], e[3]) for m, log in logs.items() for e in log["events"] if e[0] == "acquire")
    releases = {e[1]: (m, e[3]) for m, log in logs.items() for e in log["events"] if e[0] == "release"}
    seqs = [a[0] for a in acquires]
    assert seqs == list(range(1, len(seqs) + 1)), "grants are contiguous and each taken exactly once"
    on_demand = [m for m, mode in members if mode == ON_DEMAND]
    for m in on_demand:
        assert sum(1 for a in acquires if a[1] == m) == cycles
    for (seq, holder, _, t_acquire), nxt in itertools.pairwise(acquires):
        released_by, t_release = releases[seq]
        assert released_by == holder
        assert t_acquire <= t_release <= nxt[3], f"grant {seq + 1} came before {holder} released {seq}"
        if holder in on_demand:
            assert nxt[2]["by"] == holder, "the grant carries the previous holder's payload"
    for m, log in logs.items():
        assert log["clean"], f"{m}'s audit of the grant ledger: {log['audit']}"
        own = max(a[0] for a in acquires if a[1] == m)
        assert log["audit"]["next_expected"] > own, f"{m} audited every grant up to its last one"
    fallback = next(m for m, mode in members if mode == FALLBACK)
    assert logs[fallback]["audit"]["next_expected"] == len(seqs) + 1
    # When the last member audited, everyone else had left: what every reader read is reclaimed.
    assert logs[fallback]["ledger_retained"] <= 2, "ledger entries are reclaimed"
