"""Weight sync: from "the trainer holds version v+1" to "the engine serves v+1", over each transport, in
one run on this machine.

    uv run python bench/weight_sync.py [--models qwen3-0.6b qwen3-1.7b] [--versions 3] [--dtype bfloat16]
        [--transports disk shared-memory collective collective+delta] [--device cpu] [--engine torch]
        [--lora-ranks 8 32 64] [--lora-targets wq wk wv wo] [--no-full]

The trainer (this process, one rank, random weights) publishes versions in `--dtype` as a recipe's
`publish` would: `disk` (HF safetensors directories), `shared-memory` (buckets on this host) and
`collective` (buckets broadcast on a gloo weight-sync group), and `collective+delta` (only what changed
since the previous version; its first, whole version is not timed). One TorchEngine in a child process loads
each version, verifying its checksum, as the inference service does; the announcement reaches it over a
queue, standing in for the `weights` stream. Between versions the weights change as one RL step at
lr 1e-6 changes them (every float32 weight moves by 1e-6; not timed). Each transport runs `--versions`
versions; the table shows the median seconds from publish start to the engine holding the version, the
MB moved per version (and its share of a whole version), GB/s and the speedup over disk. With `--device
cuda` the trainer's model and the engine are on GPU 0 (the transports still go through host memory).

LoRA rows (`--lora-ranks`; none with an empty list): the same model with adapters of that rank on
`--lora-targets` (alpha = 2 rank), published as LoRA versions: each moves the adapters only, the base once
(with the transport's first version, not timed). Between versions one RL step moves the adapters only; a
LoRA row's share of a version is of a version of the adapters.
Each row's bytes and seconds are also shown as a share of the whole model's on the same transport, measured
in the same run (`--no-full` leaves the whole-model rows out, and so the shares).

`--engine sglang` times an SGLangEngine instead (`uv sync --extra sglang`; on a machine without CUDA
run it with PYTHONPATH=tests/infer/sglang_stub, the SGLang tier's stand-in for SGLang's kernels): it
loads disk versions from disk and shared-memory ones as tensor updates, and its scheduler receives
collective ones itself, on SGLang's own update group, verified there by Meshy's SGLang plugin.
"""

import argparse
import asyncio
import contextlib
import math
import multiprocessing
import os
import queue
import statistics
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from meshy.dataplane.weight_sync import WeightSyncGroup
from meshy.dataplane.weights import DTYPES, Published, Transport
from meshy.infer.torch_engine import TorchEngine
from meshy.train.lora import lora_config_of
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.publish import CollectivePublisher, DirectoryPublisher, SharedMemoryPublisher, adapter_specs
from meshy.train.training_config import LoraConfig, ParallelConfig

TRANSPORTS = ("disk", "shared-memory", "collective", "collective+delta")


class QueueStream:
    """What a publisher appends to the `weights` stream goes to the engine process's queue."""

    def __init__(self, queue: multiprocessing.Queue):
        self.queue = queue

    def append(self, stream: str, payload: dict) -> int:
        self.queue.put(payload)
        return 0

    def reader(self, stream: str, name: str, start: str) -> SimpleNamespace:
        """The resync stream: the engine here never fails to rebuild a delta, so nothing is asked."""
        return SimpleNamespace(read=lambda max_n: [])


def next_announcement(announced, parent: int) -> dict | None:
    """The next version announced, or None once the bench is done or its process has died (so a killed
    bench does not leave its engine, and SGLang's busy schedulers, running)."""
    while os.getppid() == parent:
        with contextlib.suppress(queue.Empty):
            return announced.get(timeout=1.0)
    return None


def engine_process(port: int | None, first: str, dtype: str, device: str, announced, done) -> None:
    """The engine: TorchEngine in the weight-sync group on the store at `port`, or (no port) an
    SGLangEngine whose schedulers join the group where the first collective version says."""
    parent = os.getppid()
    if port is None:
        from meshy.infer.sglang_engine import SGLangEngine

        group = None
        engine = SGLangEngine(first, max_running=1, max_len=8, dtype=dtype, device=device, weight_sync_rank=1)
    else:
        group = WeightSyncGroup(dist.TCPStore("127.0.0.1", port, 2, is_master=False), 1, 2, timeout_s=600)
        engine = TorchEngine(first, max_running=1, max_len=8, dtype=dtype, device=device)
    loop = asyncio.new_event_loop()
    done.put(engine.weight_version)
    base = None  # the LoRA base the engine holds, once a LoRA version brought it
    while (message := next_announcement(announced, parent)) is not None:
        published = Published.from_message(message)
        received = published.transport is Transport.COLLECTIVE and group
        source = group.receive(published, held_base=base)[1] if received else published
        adapter = published.adapter if received else None  # a Published source says its own
        loop.run_until_complete(engine.update_weights(published.version, source, adapter))
        base = None if published.adapter is None else published.adapter.base
        assert engine.weight_version == published.version
        if device == "cuda":
            torch.cuda.synchronize()  # the copies into the engine's parameters have landed
        done.put(time.monotonic())
        del source
    loop.run_until_complete(engine.close())


def rl_step(model: torch.nn.Module, step: int) -> None:
    """What one Adam step at lr 1e-6 does to the float32 weights it trains (a LoRA model's adapters only):
    each moves by about the learning rate."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype).sign(), alpha=1e-6)


def bench_model(name: str, args: argparse.Namespace, root: Path) -> Iterator[dict]:
    """Rows for the whole model (`lora` None) on every transport, then for each LoRA rank."""
    arch = get_model(name)
    model, _ = build_model(arch, ParallelConfig(), device=args.device, seed=0)
    first = DirectoryPublisher(root / "first", arch, dtype=args.dtype).publish(model, 0).location
    ctx = multiprocessing.get_context("spawn")
    announced, done = ctx.Queue(), ctx.Queue()
    if args.engine == "sglang":  # its scheduler joins the group this process hosts
        group, port = WeightSyncGroup.hosting("127.0.0.1", 2, "meshy-weights", timeout_s=600), None
    else:
        wait = timedelta(seconds=600)
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=wait)
        port = store.port
    engine = ctx.Process(target=engine_process, args=(port, first, args.dtype, args.device, announced, done))
    engine.start()
    if port is not None:
        group = WeightSyncGroup(store, 0, 2, timeout_s=600)
    done.get(timeout=600)  # the engine is up, serving version 0
    stream = QueueStream(announced)
    version = 0
    try:
        for rank in ([None] if args.full else []) + args.lora_ranks:
            if rank is not None:  # the same base (same seed), with adapters
                del model
                lora = LoraConfig(rank=rank, alpha=2.0 * rank, targets=tuple(args.lora_targets))
                model, _ = build_model(arch, ParallelConfig(), device=args.device, seed=0, lora=lora)
            where = f"{name}-{'full' if rank is None else f'r{rank}'}"
            for transport in args.transports:
                publisher = make_publisher(transport, root, where, arch, stream, group, args)
                row, version = time_versions(publisher, model, transport, args, done, version)
                del publisher  # one at a time: a 1.7B model's buffers take GBs
                yield {"model": name, "transport": transport, "lora": rank, **row}
    finally:
        announced.put(None)
        engine.join(120)


def make_publisher(transport: str, root: Path, where: str, arch, stream: QueueStream, group, args):
    if transport == "disk":
        return DirectoryPublisher(root / where, arch, stream, dtype=args.dtype, keep=1)
    if transport == "shared-memory":
        return SharedMemoryPublisher(f"meshy-bench-{where}", arch, stream, dtype=args.dtype, keep=1)
    delta = transport == "collective+delta"
    return CollectivePublisher(group, arch, stream, dtype=args.dtype, delta=delta, full_every=1000)


def adapter_bytes(model: torch.nn.Module, arch, dtype: str) -> int:
    return sum(math.prod(shape) * t.itemsize for _, t, shape in adapter_specs(model, arch, DTYPES[dtype]))


def time_versions(publisher, model, transport: str, args, done, version: int) -> tuple[dict, int]:
    """Publish `args.versions` timed versions (after an untimed first one where it is not what is timed: the
    whole version deltas start from, a LoRA run's base); the row, and the last version published."""
    lora = lora_config_of(model) is not None
    untimed = transport == "collective+delta" or lora
    seconds, moved, full = [], [], None
    try:
        for _ in range(args.versions + untimed):
            version += 1
            rl_step(model, version)
            start = time.monotonic()
            published = publisher.publish(model, version)
            arrived = done.get(timeout=600)
            if full is None:  # a whole version's bytes (of the adapters, for LoRA: the first carries the base)
                full = published.num_bytes if not lora else adapter_bytes(model, publisher.arch, args.dtype)
                if untimed:
                    continue  # the whole version the deltas start from, or the LoRA base
            seconds.append(arrived - start)
            moved.append(published.num_bytes)
    finally:
        if isinstance(publisher, SharedMemoryPublisher):
            publisher.close()
    return {
        "gb": statistics.median(moved) / 1e9,
        "share": statistics.median(moved) / full,
        "s": statistics.median(seconds),
    }, version


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-1.7b"])
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--engine", default="torch", choices=["torch", "sglang"])
    parser.add_argument("--lora-ranks", nargs="*", type=int, default=[8, 32, 64])
    parser.add_argument("--lora-targets", nargs="+", default=list(LoraConfig().targets))
    parser.add_argument("--no-full", dest="full", action="store_false", help="no whole-model rows")
    args = parser.parse_args()
    where = "CPU" if args.device == "cpu" else "GPU 0"
    print(
        f"\nweight sync, {args.dtype}, median of {args.versions} versions, trainer and {args.engine} engine on "
        f"this host ({where}); LoRA on {' '.join(args.lora_targets)}, alpha = 2 rank"
    )
    print(
        "| model | transport | weights | MB moved per version | share of a version | seconds | GB/s | vs disk "
        "| bytes vs full | seconds vs full |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.models:
        with tempfile.TemporaryDirectory(prefix="meshy-bench-weights-") as root:
            disk, full = {}, {}  # by LoRA rank: the disk row's seconds; by transport: the whole model's row
            for row in bench_model(name, args, Path(root)):  # printed as measured: a long run keeps what it has
                if row["transport"] == "disk":
                    disk[row["lora"]] = row["s"]
                if row["lora"] is None:
                    full[row["transport"]] = row
                speedup = f"{disk[row['lora']] / row['s']:.2f}x" if row["lora"] in disk else "-"
                whole = full.get(row["transport"]) if row["lora"] is not None else None
                shares = f"{row['gb'] / whole['gb']:.2%} | {row['s'] / whole['s']:.1%}" if whole else "- | -"
                weights = "full" if row["lora"] is None else f"LoRA r{row['lora']}"
                print(
                    f"| {row['model']} | {row['transport']} | {weights} | {row['gb'] * 1e3:.1f} | {row['share']:.1%} | "
                    f"{row['s']:.3f} | {row['gb'] / row['s']:.2f} | {speedup} | {shares} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
