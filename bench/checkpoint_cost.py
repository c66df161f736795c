"""What checkpointing every version costs the default recipe: off, in the foreground, in the background.

    uv run python bench/checkpoint_cost.py [--steps 200] [--repeats 2] [--pacing 1]

Each row is a real `meshy run` of the embedded default recipe (tiny Qwen3, arithmetic, GRPO), changed only
in `checkpoint_every` (0 or 1) and `checkpoint_in_background`; the modes run interleaved, `--repeats` times.
A version's time is the interval between consecutive metrics lines (the trainer's own clock), averaged over
the versions after the first `--warmup`; the cost is that mean against the mean of the runs without
checkpoints. Every checkpoint of a run with them is checked complete (manifest and files) at the end.
"""

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from meshy.train import checkpoint

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20, help="versions left out of the means")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pacing", default="1", help="algorithm.pacing: 1, 2, ... or '\"none\"'")
    args = parser.parse_args()
    rows = [measure(mode, args) for _ in range(args.repeats) for mode in MODES]
    base = statistics.fmean(r["mean_s"] for r in rows if r["mode"] == "off")
    print(f"default recipe, {args.steps} versions, pacing {args.pacing}; means over versions {args.warmup + 1}+")
    print("| mode | s per version (mean) | median | vs off | checkpoints | MB each |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cost = f"{100 * (r['mean_s'] / base - 1):+.1f}%"
        print(
            f"| {r['mode']} | {r['mean_s']:.3f} | {r['median_s']:.3f} | {cost} | {r['checkpoints']} | "
            f"{r['checkpoint_mb']:.1f} |"
        )
    for mode in MODES:
        mean = statistics.fmean(r["mean_s"] for r in rows if r["mode"] == mode)
        print(f"{mode}: {mean:.3f} s per version, {100 * (mean / base - 1):+.1f}% against off")


if __name__ == "__main__":
    main()
