"""One rank of the torchrun test: rank 0 hosts the data plane and publishes its endpoints through
torchrun's TCPStore; every rank leases whole groups of one task directly (no leader, no broadcast)."""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from meshy.dataplane import (
    Column,
    DataPlaneClient,
    DataPlaneServer,
    Endpoints,
    TableSpec,
    secret_from_env,
)

ROWS, GROUP = 90, 3


def main() -> None:
    out = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(seconds=120),
    )
    secret = secret_from_env()
    server = DataPlaneServer.start(secret) if rank == 0 else None
    if server is not None:
        server.publish(store)
    client = DataPlaneClient(Endpoints.from_store(store, timeout_s=120), secret, name=f"rank{rank}")
    client.create_table(TableSpec("rollout", (Column("x", "int64"),), group_size=GROUP))  # every rank declares it
    store.add("ready", 1)
    if rank == 0:
        while store.add("ready", 0) < world:
            time.sleep(0.01)
        for start in range(0, ROWS, 2 * GROUP):
            rows = list(range(start, start + 2 * GROUP))
            client.put("rollout", rows, {"x": torch.tensor(rows)}, group_ids=[r // GROUP for r in rows])
            time.sleep(0.01)
    received = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        batch = client.lease("rollout", "train", ["x"], count=1, whole_groups=True, timeout=0.2)
        if batch is None:
            if client.table_stats("rollout")["tasks"]["train"]["done"] == ROWS:
                break
            continue
        assert batch.columns["x"].tolist() == batch.row_ids
        time.sleep(0.02)  # the work
        client.ack(batch)
        received.append(batch.row_ids)
    (out / f"rank{rank}.json").write_text(json.dumps(received))
    store.add("done", 1)
    if server is not None:
        while store.add("done", 0) < world:
            time.sleep(0.05)
        client.close()
        server.shutdown()


if __name__ == "__main__":
    main()
