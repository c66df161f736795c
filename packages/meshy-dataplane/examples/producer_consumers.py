"""A producer and two consumers in separate processes, meeting only through one data plane.

    python packages/meshy-dataplane/examples/producer_consumers.py

The producer (this process) starts the data-plane servers and a torch.distributed TCPStore, publishes the
servers' endpoints in the store, and starts two consumer processes with the run's secret in their
environment (never on a command line); each finds the endpoints in the store. The producer writes groups
of scored rows, then says on the `done` stream how many it wrote; each consumer leases whole groups
directly (no leader, no broadcast), computes their advantages and acks them, until every row is acked.
The producer then checks that the consumers got disjoint groups that cover every row.
"""

import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from meshy.dataplane import (
    HOST,
    Column,
    DataPlaneClient,
    DataPlaneServer,
    Endpoints,
    TableSpec,
    new_secret,
    secret_from_env,
)

SECRET_ENV = "MESHY_DATAPLANE_SECRET"
GROUP, GROUPS = 4, 12
TABLE = TableSpec(
    "rollout",
    (Column("prompt_ids", "int64", (None,)), Column("reward", "float32")),  # ragged ids, one reward per row
    group_size=GROUP,
)
CONSUMERS = ("consumer-0", "consumer-1")
TIMEOUT_S = 120.0


def produce(client: DataPlaneClient) -> None:
    for g in range(GROUPS):
        prompt = torch.randint(0, 100, (3 + g % 5,), device=HOST)
        rows = [g * GROUP + k for k in range(GROUP)]
        rewards = torch.randint(0, 2, (GROUP,), device=HOST).float()
        client.put("rollout", rows, {"prompt_ids": [prompt] * GROUP, "reward": rewards}, group_ids=[g] * GROUP)
    client.append("done", {"rows": GROUPS * GROUP})


def consume(port: int, name: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    client = DataPlaneClient(Endpoints.from_store(store, timeout_s=TIMEOUT_S), secret_from_env(), name=name)
    client.create_table(TABLE)  # every process declares it; the schemas must agree
    done = client.reader("done", name, start=1)
    total, mine, deadline = None, [], time.monotonic() + TIMEOUT_S
    while total is None or client.table_stats("rollout")["tasks"]["train"]["done"] < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: rows still not all acked after {TIMEOUT_S:.0f} s (producer done: {total})")
        batch = client.lease("rollout", "train", ["prompt_ids", "reward"], count=1, whole_groups=True, timeout=0.5)
        if batch is not None:
            rewards = batch.columns["reward"].view(-1, GROUP)
            advantages = rewards - rewards.mean(dim=1, keepdim=True)  # the work: a group baseline
            client.ack(batch)
            mine += batch.row_ids
            print(f"{name}: group {batch.group_ids[0]}, advantages {advantages.flatten().tolist()}", flush=True)
        elif total is None:
            total = next((m.payload["rows"] for m in done.read(max_n=1)), None)
    store.set(f"rows/{name}", json.dumps(mine))
    client.close()


def main() -> int:
    secret = new_secret()
    with DataPlaneServer.start(secret) as server:  # controller + storage unit, on 127.0.0.1
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        server.publish(store)  # the endpoints, for every process that can reach the store
        env = {**os.environ, SECRET_ENV: secret.hex()}
        command = [sys.executable, __file__, str(store.port)]
        consumers = [subprocess.Popen([*command, name], env=env) for name in CONSUMERS]
        try:
            client = DataPlaneClient(server.endpoints, secret, name="producer")
            client.create_table(TABLE)
            produce(client)
            failed = [p.args for p in consumers if p.wait(TIMEOUT_S + 60) != 0]
        finally:
            for p in consumers:
                p.kill()  # only one still running after a failure: the others have exited
        if failed:
            print(f"failed: {failed}", file=sys.stderr)
            return 1
        rows = {name: json.loads(store.get(f"rows/{name}")) for name in CONSUMERS}
        client.close()
    got = sorted(r for mine in rows.values() for r in mine)
    if got != list(range(GROUPS * GROUP)):
        print(f"rows acked: {got}; expected each of 0..{GROUPS * GROUP - 1} once", file=sys.stderr)
        return 1
    counts = ", ".join(f"{name} {len(mine) // GROUP}" for name, mine in rows.items())
    print(f"every row acked once: {GROUPS} groups of {GROUP} ({counts} groups)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main() if len(sys.argv) == 1 else consume(int(sys.argv[1]), sys.argv[2]))
