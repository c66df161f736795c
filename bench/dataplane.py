"""meshy.dataplane against the raw TransferQueue client, in one run, on this machine.

    uv run python bench/dataplane.py [--reps 10] [--latency-reps 300]

Throughput: put + get of 1024 RL-shaped rows (int64[4096] tokens, float32[4096] logprobs, 3 scalars),
through meshy (put, lease, ack) and through TransferQueue's client (put, get_meta, get_data, clear).
Latency: the same with one row. Both use one storage unit on loopback; meshy also authenticates. Meshy runs
again with its rows logged to disk too (`durable`: batched at three fsync intervals, and sync), each beside the
in-memory run.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import ClassVar

import torch
from tensordict import TensorDict
from transfer_queue import TransferQueueClient
from transfer_queue.utils.enum_utils import Role
from transfer_queue.utils.zmq_utils import ZMQServerInfo

from meshy.dataplane import HOST, Column, DataPlaneClient, DataPlaneConfig, DataPlaneServer, TableSpec, new_secret

SEQ = 4096
ROWS = 1024
SCALARS = ("reward", "advantage", "version")


def make_rows(n: int) -> dict[str, torch.Tensor]:
    rows = {"tokens": torch.randint(0, 150_000, (n, SEQ), device=HOST), "logprobs": torch.randn(n, SEQ, device=HOST)}
    rows.update({s: torch.randn(n, device=HOST) for s in SCALARS})
    return rows


def nbytes(rows: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in rows.values())


class Meshy:
    name = "meshy.dataplane"
    durable: ClassVar[dict] = {}  # DataPlaneConfig's durable fields; none: rows in memory only

    def __init__(self) -> None:
        secret = new_secret()
        self.logs = tempfile.TemporaryDirectory() if self.durable else None
        where = {"durable_dir": self.logs.name} if self.logs else {}
        self.server = DataPlaneServer.start(secret, DataPlaneConfig(num_storage_units=1, **self.durable, **where))
        self.client = DataPlaneClient(self.server.endpoints, secret)
        columns = (Column("tokens", "int64", (SEQ,)), Column("logprobs", "float32", (SEQ,)))
        columns += tuple(Column(s, "float32") for s in SCALARS)
        self.client.create_table(TableSpec("bench", columns, retire_after=("train",)))
        self.next_row = 0

    def round_trip(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        n = len(rows["tokens"])
        ids = list(range(self.next_row, self.next_row + n))
        self.next_row += n
        self.client.put("bench", ids, rows)
        batch = self.client.lease("bench", "train", list(rows), count=n, timeout=10)
        self.client.ack(batch)
        return batch.columns

    def close(self) -> None:
        self.client.close()
        self.server.shutdown()
        if self.logs is not None:
            self.logs.cleanup()


def durable_meshy(mode: str, sync_s: float = 0.1) -> type[Meshy]:
    """Meshy with its rows logged to disk too (DataPlaneConfig.durable)."""
    label = f"{mode}, fsync every {sync_s:g} s" if mode == "batched" else mode
    fields = {"durable": mode, "durable_sync_s": sync_s}
    return type(f"Durable{mode}{sync_s}", (Meshy,), {"name": f"meshy, rows on disk ({label})", "durable": fields})


class RawTransferQueue:
    name = "TransferQueue client"

    def __init__(self) -> None:
        script = Path(__file__).with_name("_raw_transfer_queue.py")
        self.proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        infos = json.loads(self.proc.stdout.readline())
        to_info = {k: ZMQServerInfo(Role(v["role"]), v["id"], v["ip"], v["ports"]) for k, v in infos.items()}
        self.client = TransferQueueClient("bench", to_info["controller"])
        self.client.initialize_storage_manager(
            "SimpleStorage", {"zmq_info": {infos["storage"]["id"]: to_info["storage"]}}
        )
        self.step = 0

    def round_trip(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        n = len(rows["tokens"])
        partition = f"p{self.step}"
        self.step += 1
        self.client.put(TensorDict(rows, batch_size=n), partition_id=partition)
        meta = self.client.get_meta(list(rows), n, partition, mode="fetch", task_name="train")
        data = self.client.get_data(meta)
        self.client.clear_partition(partition)
        return dict(data.items())

    def close(self) -> None:
        self.client.close()
        self.proc.stdin.close()
        self.proc.wait()


def measure(system, rows: dict[str, torch.Tensor], reps: int) -> list[float]:
    out = system.round_trip(rows)  # warm up, and check the data survived the trip
    for k, v in rows.items():
        got = out[k]
        got = got.to_padded_tensor(0) if getattr(got, "is_nested", False) else got
        assert torch.equal(got.reshape(v.shape), v), f"{system.name} corrupted column {k}"
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        system.round_trip(rows)
        times.append(time.perf_counter() - t0)
    return times


SYSTEMS = {
    "tq": RawTransferQueue,
    "meshy": Meshy,
    "meshy-batched-0.01": durable_meshy("batched", 0.01),
    "meshy-batched-0.1": durable_meshy("batched", 0.1),
    "meshy-batched-1": durable_meshy("batched", 1.0),
    "meshy-sync": durable_meshy("sync"),
}


def run_one(name: str, reps: int, latency_reps: int) -> None:
    """Measure one system in this (fresh) process and print its timings as JSON."""
    torch.manual_seed(0)
    system = SYSTEMS[name]()
    try:
        timings = {"big": measure(system, make_rows(ROWS), reps), "one": measure(system, make_rows(1), latency_reps)}
    finally:
        system.close()
    print(json.dumps(timings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--latency-reps", type=int, default=300)
    parser.add_argument("--only", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        return run_one(args.only, args.reps, args.latency_reps)

    # Each system runs in a fresh interpreter, one after the other, so neither inherits the other's
    # background threads or memory.
    results = {}
    for name, cls in SYSTEMS.items():
        cmd = [sys.executable, __file__, "--only", name, "--reps", str(args.reps)]
        out = subprocess.run([*cmd, "--latency-reps", str(args.latency_reps)], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{cls.name} failed:\n{out.stderr[-3000:]}")
        results[cls.name] = json.loads(out.stdout.strip().splitlines()[-1])

    mib = nbytes(make_rows(ROWS)) / 2**20
    reps = f"medians over {args.reps} / {args.latency_reps} reps"
    print(f"\nput + get of {ROWS} rows ({mib:.0f} MiB) and of 1 row; {reps}\n")
    width = max(len(name) for name in results)
    print(f"| {'path':<{width}} | {'rows/s':>8} | {'MiB/s':>7} | {'1-row round trip':>16} |")
    print(f"|{'-' * (width + 2)}|{'-' * 10}|{'-' * 9}|{'-' * 18}|")
    medians = {}
    for name, timings in results.items():
        m_big, m_one = statistics.median(timings["big"]), statistics.median(timings["one"])
        medians[name] = (m_big, m_one)
        print(f"| {name:<{width}} | {ROWS / m_big:>8.0f} | {mib / m_big:>7.0f} | {m_one * 1e3:>13.2f} ms |")
    (raw_big, raw_one), (meshy_big, meshy_one) = medians[RawTransferQueue.name], medians[Meshy.name]
    print(
        f"\nmeshy / raw TransferQueue: throughput {raw_big / meshy_big:.2f}x, 1-row latency {raw_one / meshy_one:.2f}x"
    )
    print("targets: throughput >= 0.90x, 1-row round trip < 3 ms")
    for name, (big, one) in medians.items():
        if name.startswith("meshy, rows on disk"):
            print(f"{name} / in memory: throughput {meshy_big / big:.2f}x, 1-row latency {meshy_one / one:.2f}x")


if __name__ == "__main__":
    main()
