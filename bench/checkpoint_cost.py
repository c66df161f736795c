"""What checkpointing every version costs: off, in the foreground, in the background.

    uv run python bench/checkpoint_cost.py [--steps 200] [--repeats 2] [--pacing 1]
    python bench/checkpoint_cost.py --trainer --device cuda --model qwen3-0.6b --dtype bfloat16

Each row is a real `meshy run` of the embedded default recipe (tiny Qwen3, arithmetic, GRPO), changed only
in `checkpoint_every` (0 or 1) and `checkpoint_in_background`; the modes run interleaved, `--repeats` times.
A version's time is the interval between consecutive metrics lines (the trainer's own clock), averaged over
the versions after the first `--warmup`; the cost is that mean against the mean of the runs without
checkpoints. Every checkpoint of a run with them is checked complete (manifest and files) at the end.

With --trainer: one PolicyTrainer of --model on --device takes --steps steps of --rows x --tokens for
each mode, a checkpoint after every step; the median time of a step with its checkpoint (what training
waits for), against steps alone. A version also generates, so this is the most a checkpoint can cost it.
"""

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from meshy.train import checkpoint
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LossConfig, OptimConfig, ParallelConfig

MODES = {
    "off": ["checkpoint_every=0"],
    "every version, foreground": ["checkpoint_every=1", "checkpoint_in_background=false"],
    "every version, background": ["checkpoint_every=1", "checkpoint_in_background=true"],
}


def measure(mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"steps={args.steps}", f'run_dir="{tmp}"', f"algorithm.pacing={args.pacing}", *MODES[mode]]
        command = [sys.executable, "-m", "meshy.recipes.cli", "run"] + [a for s in sets for a in ("--set", s)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"{mode} failed:\n{result.stderr[-3000:]}")
        (run_dir,) = [p for p in Path(tmp).iterdir() if p.is_dir()]
        times = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        saved = checkpoint.saved(run_dir / "checkpoints")
        for path in saved:
            checkpoint.verify(path)
        size = sum(f.stat().st_size for f in saved[-1].iterdir()) if saved else 0
    steady = times[args.warmup :]
    intervals = [b - a for a, b in itertools.pairwise(steady)]
    return {
        "mode": mode,
        "versions": len(times),
        "mean_s": statistics.fmean(intervals),
        "median_s": statistics.median(intervals),
        "checkpoints": len(saved),
        "checkpoint_mb": size / 1e6,
    }


def trainer_steps(mode: str, args: argparse.Namespace) -> dict:
    """--trainer: the median seconds of a step with the checkpoint after it, and of the checkpoint alone."""
    device = torch.device(args.device)
    arch = get_model(args.model)
    parallel = ParallelConfig(activation_checkpoint="full")
    model, _ = build_model(arch, parallel, device=device, dtype=args.dtype, seed=0)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-5), LossConfig())
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    generator = torch.Generator(device="cpu").manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        background = checkpoint.BackgroundSaves(root) if mode.endswith("background") else None
        steps, saves = [], []
        for step in range(args.steps + 2):  # the first two not timed
            tokens = torch.randint(0, arch.vocab_size, (args.rows, args.tokens), generator=generator).to(device)
            mask = torch.ones(args.rows, args.tokens - 1, device=device)
            advantages = torch.randn(args.rows, generator=generator).to(device)
            rollout = torch.full((args.rows, args.tokens - 1), -2.0, device=device)
            sync()
            start = time.perf_counter()
            trainer.step(PolicyBatch(tokens, mask, advantages, rollout_logprobs=rollout))
            sync()
            trained = time.perf_counter()
            if background is not None:
                background.save(step, trainer, {"version": step})
            elif mode != "off":
                checkpoint.save(root, step, trainer, {"version": step})
            steps.append(time.perf_counter() - start)
            saves.append(time.perf_counter() - trained)
            for older in checkpoint.saved(root)[:-1]:  # one on disk at a time: a 0.6B one is gigabytes
                shutil.rmtree(older)
        if background is not None:
            background.close()
        size = sum(f.stat().st_size for f in checkpoint.latest(root).iterdir()) if mode != "off" else 0
    return {
        "mode": mode,
        "step_s": statistics.median(steps[2:]),
        "blocked_s": statistics.median(saves[2:]),
        "mb": size / 1e6,
    }


def print_table(rows: list[dict], time: str, columns: dict[str, str]) -> None:
    """One line per row: its mode, `time` (seconds) against the mean of the runs without checkpoints, and
    `columns` (header: format of the row's fields)."""
    base = statistics.fmean(r[time] for r in rows if r["mode"] == "off")
    print("| mode | " + " | ".join(columns) + " | vs off |")
    print("|---|" + "---|" * (len(columns) + 1))
    for r in rows:
        print(
            f"| {r['mode']} | "
            + " | ".join(f.format(**r) for f in columns.values())
            + f" | {r[time] / base - 1:+.1%} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20, help="versions left out of the means")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pacing", default="1", help="algorithm.pacing: 1, 2, ... or '\"none\"'")
    parser.add_argument("--trainer", action="store_true", help="a trainer's steps alone, not a run")
    parser.add_argument("--device", default="cpu", help="--trainer: where the model is")
    parser.add_argument("--model", default="qwen3-tiny", help="--trainer: the model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="--trainer")
    parser.add_argument("--rows", type=int, default=4, help="--trainer: rows per step")
    parser.add_argument("--tokens", type=int, default=256, help="--trainer: tokens per row")
    args = parser.parse_args()
    if args.trainer:
        rows = [trainer_steps(mode, args) for _ in range(args.repeats) for mode in MODES]
        print(f"{args.model} {args.dtype} on {args.device}, steps of {args.rows} x {args.tokens} tokens, medians")
        columns = {"s per step with its checkpoint": "{step_s:.3f}", "checkpoint blocks s": "{blocked_s:.3f}"}
        print_table(rows, "step_s", {**columns, "MB each": "{mb:.1f}"})
        return
    rows = [measure(mode, args) for _ in range(args.repeats) for mode in MODES]
    base = statistics.fmean(r["mean_s"] for r in rows if r["mode"] == "off")
    print(f"default recipe, {args.steps} versions, pacing {args.pacing}; means over versions {args.warmup + 1}+")
    columns = {"s per version (mean)": "{mean_s:.3f}", "median": "{median_s:.3f}", "checkpoints": "{checkpoints}"}
    print_table(rows, "mean_s", {**columns, "MB each": "{checkpoint_mb:.1f}"})
    for mode in MODES:
        mean = statistics.fmean(r["mean_s"] for r in rows if r["mode"] == mode)
        print(f"{mode}: {mean:.3f} s per version, {100 * (mean / base - 1):+.1f}% against off")


if __name__ == "__main__":
    main()
