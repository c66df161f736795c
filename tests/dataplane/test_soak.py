"""Slow tier: consumers killed at random while producers keep writing; nothing lost, nothing acked twice."""

import json
import os
import random
import signal
import time

import pytest
import torch

from meshy.dataplane import Column, TableSpec
from tests.dataplane import workers

pytestmark = pytest.mark.slow

GROUP, GROUPS = 4, 150


def test_random_consumer_kills_lose_nothing_and_ack_nothing_twice(
    client, unique, dataplane, secret, mp_context, tmp_path
):
    table = client.create_table(TableSpec(unique("soak"), (Column("x", "int64"),), group_size=GROUP)).name
    endpoints = dataplane.endpoints.to_json()
    logs = []

    def spawn():
        logs.append(tmp_path / f"consumer{len(logs)}.jsonl")
        proc = mp_context.Process(
            target=workers.churn_consumer, args=(endpoints, secret, table, "train", str(logs[-1]))
        )
        proc.start()
        return proc

    consumers = [spawn() for _ in range(3)]
    rng = random.Random(0)
    kills, next_group = 0, 0
    deadline = time.monotonic() + 120
    while client.table_stats(table)["tasks"].get("train", {}).get("done", 0) < GROUP * GROUPS:
        assert time.monotonic() < deadline, client.table_stats(table)
        if next_group < GROUPS:  # the producer: a few groups at a time, interleaved with the kills
            groups = range(next_group, min(GROUPS, next_group + 10))
            rows = [g * GROUP + k for g in groups for k in range(GROUP)]
            client.put(table, rows, {"x": torch.tensor(rows)}, group_ids=[r // GROUP for r in rows])
            next_group = groups[-1] + 1
        time.sleep(0.3)
        if rng.random() < 0.5:
            victim = consumers.pop(rng.randrange(len(consumers)))
            os.kill(victim.pid, signal.SIGKILL)
            victim.join()
            kills += 1
            consumers.append(spawn())
    for proc in consumers:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()

    acked = [
        r for log in logs if log.exists() for line in log.read_text().splitlines() for r in json.loads(line)["acked"]
    ]
    assert kills >= 5
    assert len(acked) == len(set(acked)), "a row was acked twice"
    assert client.table_stats(table)["tasks"]["train"] == {"ready": 0, "leased": 0, "done": GROUP * GROUPS}
