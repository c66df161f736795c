"""A data-plane demo: `python -m meshy.dataplane.demo` (or `meshy demo`).

Four roles, each with its own client, meet only through one table and the `weights` stream: rollout
writes groups of prompts paced by weight versions (on-policy, W = 1), inference leases prompts and
writes responses and rewards (acking its input atomically), and two trainer ranks each lease whole
groups directly and compute group-relative advantages; rank 0 announces each new weights version.
The ranks step together, as the training service's do: a rank that ran ahead would lease, for its
next step, the groups the other rank is still waiting for, and the run would stall.
"""

import argparse
import sys
import threading
import time

import torch

from meshy.dataplane.client import DataPlaneClient
from meshy.dataplane.config import DataPlaneConfig
from meshy.dataplane.devices import HOST
from meshy.dataplane.schema import Column, TableSpec
from meshy.dataplane.server import DataPlaneServer, new_secret

GROUP = 4
GROUPS_PER_STEP = 4
WAIT_S = 60.0  # longest any role waits for another
TABLE = TableSpec(
    "rollout",
    (
        Column("prompt_ids", "int64", (None,)),
        Column("response_ids", "int64", (None,)),
        Column("reward", "float32"),
    ),
    group_size=GROUP,
    retire_after=("train",),
)


def rollout(client: DataPlaneClient, steps: int) -> None:
    weights = client.reader("weights", "rollout", start=1)
    for step in range(steps):
        if step > 0 and not weights.read(max_n=1, timeout=WAIT_S):  # W = 1: the previous step's weights
            raise TimeoutError(f"no weights version {step} in {WAIT_S:.0f} s")
        for g in range(step * GROUPS_PER_STEP, (step + 1) * GROUPS_PER_STEP):
            prompt = torch.randint(0, 100, (int(torch.randint(3, 9, (), device=HOST)),), device=HOST)
            rows = [g * GROUP + k for k in range(GROUP)]
            client.put("rollout", rows, {"prompt_ids": [prompt] * GROUP}, group_ids=[g] * GROUP)


def inference(client: DataPlaneClient, stop: threading.Event) -> None:
    while not stop.is_set():
        batch = client.lease("rollout", "generate", ["prompt_ids"], count=8, min_count=1, timeout=0.5)
        if batch is None:
            continue
        responses = [
            torch.cat([p.flip(0), torch.randint(0, 100, (int(torch.randint(0, 4, (), device=HOST)),), device=HOST)])
            for p in batch.columns["prompt_ids"]
        ]
        rewards = torch.tensor([float(len(r) % 2 == 0) for r in responses], device=HOST)
        client.add_columns("rollout", batch.row_ids, {"response_ids": responses, "reward": rewards}, ack=batch)


def trainer(client: DataPlaneClient, rank: int, steps: int, report: list, ranks: threading.Barrier) -> None:
    try:
        for step in range(steps):
            batch = client.lease(
                "rollout", "train", ["response_ids", "reward"], GROUPS_PER_STEP // 2, whole_groups=True, timeout=WAIT_S
            )
            if batch is None:
                raise TimeoutError(f"trainer rank {rank}: no batch for step {step} in {WAIT_S:.0f} s")
            together(ranks, f"trainer rank {rank}: the other rank holding its groups for step {step}")
            rewards = batch.columns["reward"].view(-1, GROUP)
            advantages = rewards - rewards.mean(dim=1, keepdim=True)
            client.ack(batch)
            report.append(
                (step, rank, sorted(set(batch.group_ids)), rewards.mean().item(), advantages.abs().mean().item())
            )
            together(ranks, f"trainer rank {rank}: the other rank finishing step {step}")
            if rank == 0:
                client.append("weights", {"version": step + 1})
    except BaseException:
        ranks.abort()  # the other rank fails now instead of waiting out WAIT_S
        raise


def together(ranks: threading.Barrier, waiting_for: str) -> None:
    try:
        ranks.wait(WAIT_S)
    except threading.BrokenBarrierError:
        raise TimeoutError(f"{waiting_for}: it failed or did not come within {WAIT_S:.0f} s") from None


def role_thread(name: str, target, args: tuple, failures: list[str]) -> threading.Thread:
    """A role on its own thread; what stops it is kept, so the demo ends with an error, not a silent 0."""

    def run() -> None:
        try:
            target(*args)
        except Exception as err:
            failures.append(f"{name}: {type(err).__name__}: {err}")
            raise

    return threading.Thread(target=run, name=name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshy demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    secret = new_secret()
    t0 = time.monotonic()
    print("starting the data plane (controller + 2 storage units, loopback, per-run secret) ...", flush=True)
    with DataPlaneServer.start(secret, DataPlaneConfig(num_storage_units=2)) as server:
        print(f"  up in {time.monotonic() - t0:.1f}s: pids {server.pids}")
        clients = [DataPlaneClient(server.endpoints, secret, name=n) for n in ("rollout", "infer", "rank0", "rank1")]
        clients[0].create_table(TABLE)
        versions = clients[0].reader("weights", "audit", start=1)  # registered now: sees every version
        stop, report, failures, ranks = threading.Event(), [], [], threading.Barrier(2)
        roles = [
            role_thread("rollout", rollout, (clients[0], args.steps), failures),
            role_thread("inference", inference, (clients[1], stop), failures),
            *(
                role_thread(f"trainer {r}", trainer, (clients[2 + r], r, args.steps, report, ranks), failures)
                for r in (0, 1)
            ),
        ]
        for role in roles:
            role.start()
        for role in roles[2:]:
            role.join()
        stop.set()
        for role in roles[:2]:
            role.join()
        for step, rank, groups, reward, adv in sorted(report):
            print(f"  step {step}  trainer rank {rank}  groups {groups}  mean reward {reward:.2f}  |adv| {adv:.2f}")
        seen = [m.payload["version"] for m in versions.read()]
        print(f"weights versions announced: {seen}  (stream audit clean: {versions.audit.clean})")
        print(f"table: {clients[0].table_stats('rollout')}")
        for client in clients:
            client.close()
    if failures:
        print(f"meshy demo: failed after {time.monotonic() - t0:.1f}s: {'; '.join(failures)}", file=sys.stderr)
        return 1
    print(f"done in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
