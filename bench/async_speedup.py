"""Rollout pacing on one pipeline: the same samples trained at W = 1, W = 2 and W = "none", in one run.

    uv run python bench/async_speedup.py [--steps 40]
    python bench/async_speedup.py --gpu --model qwen3-0.6b --modes W=1 W=none --steps 8

Each mode is a real `meshy run` of the embedded default recipe (tiny Qwen3, arithmetic, GRPO), changed
only in `algorithm.pacing`, with long-tailed responses: a young policy ends a response wherever it
happens to sample EOS (about 1 token in 17), so most responses are short and a few run long (with
max_new_tokens 256, the longest of a batch is typically 5-6 times the mean).
With --gpu, training and inference share GPU 0 at the same time (`share_devices`, each role within
its `memory_fraction`; weights published in shared memory), the model is `--model` (its full
vocabulary, scratch weights, so responses run to max_new_tokens), computing in bfloat16 with
activation checkpointing.
Wall time is measured from the trainer's start to its last version; busy fractions come from the run's
own records (trainer: train + publish time; inference: time with at least one request in flight).
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from meshy.recipes.recipe import DEFAULT_RECIPE

MODES = {"W=1": "1", "W=2": "2", "W=none": '"none"'}


def recipe(directory: Path, pacing: str, args: argparse.Namespace) -> Path:
    text = DEFAULT_RECIPE.read_text()
    edits = {
        "steps": args.steps,
        "pacing": pacing,
        "max_new_tokens": args.max_new_tokens,
        "run_dir": f'"{directory}"',
        "prompts_per_step": args.prompts_per_step,
        "checkpoint_every": 0,
    }
    if args.gpu:
        edits["overrides"] = "{}"
        text = text.replace('name = "qwen3-tiny"', f'name = "{args.model}"\ndtype = "bfloat16"')
    for key, value in edits.items():
        text, count = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, count=1, flags=re.M)
        assert count == 1, key
    if args.gpu:
        text = 'share_devices = [["training", "inference"]]\npublish = "shared-memory"\n' + text
        for role, fraction in (("training", args.training_fraction), ("inference", 1 - args.training_fraction)):
            text = text.replace(
                f"[roles.{role}]\nprocesses = 1",
                f"[roles.{role}]\nprocesses = 1\ndevices_per_process = 1\nmemory_fraction = {fraction:.2f}",
            )
        text += '\n[algorithm.parallel]\nactivation_checkpoint = "full"\n'
        text = re.sub(r"^pacing = ", f"minibatches = {args.minibatches}\npacing = ", text, count=1, flags=re.M)
        text = text.replace("[sampling]", f"[sampling]\ncontext_length = {args.max_new_tokens + 16}")
    path = directory / "recipe.toml"
    path.write_text(text)
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def measure(pacing: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        command = [
            sys.executable,
            "-m",
            "meshy.recipes.cli",
            "run",
            str(recipe(directory, pacing, args)),
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"pacing {pacing} failed:\n{result.stderr[-3000:]}")
        (run_dir,) = [p for p in directory.iterdir() if p.is_dir()]
        metrics = lines(run_dir / "metrics.jsonl")
        start = next(r["time"] for r in lines(run_dir / "records" / "training-0.jsonl") if r["kind"] == "train_start")
        inference = lines(run_dir / "records" / "inference-0.jsonl")[-1]
        wall = metrics[-1]["time"] - start
        hist: dict[str, int] = {}
        for m in metrics:
            for k, v in m["staleness_histogram"].items():
                hist[k] = hist.get(k, 0) + v
        tokens = sum(hist.values())
        return {
            "wall": wall,
            "samples": sum(m["rows_trained"] + m["rows_dropped"] for m in metrics),
            "trainer_busy": sum(m["train_s"] + m["publish_s"] for m in metrics) / wall,
            "inference_busy": min(1.0, inference["busy_s"] / wall),
            "reward": sum(m["reward_mean"] for m in metrics[-10:]) / len(metrics[-10:]),
            "staleness": sum(int(k.lstrip(">=")) * v for k, v in hist.items()) / tokens,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--prompts-per-step", type=int, default=32, help="groups of 8 samples per version")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--gpu", action="store_true", help="training and inference share GPU 0 at once")
    parser.add_argument("--model", default="qwen3-0.6b", help="with --gpu: the model trained")
    parser.add_argument("--training-fraction", type=float, default=0.45, help="with --gpu: training's memory share")
    parser.add_argument("--minibatches", type=int, default=8, help="with --gpu: optimizer steps per version")
    args = parser.parse_args()
    results = {name: measure(MODES[name], args) for name in args.modes}
    base = results[args.modes[0]]["wall"]
    where = f"{args.model} bfloat16 on one shared GPU" if args.gpu else "qwen3-tiny on a 2-core CPU"
    samples = args.prompts_per_step * 8
    print(f"\n{args.steps} versions x {samples} samples, {where}, max_new_tokens {args.max_new_tokens}\n")
    columns = (
        "pacing",
        "wall s",
        "samples/s",
        f"speedup vs {args.modes[0]}",
        "trainer busy",
        "inference busy",
        "reward (last 10)",
        "mean staleness",
    )
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for name, r in results.items():
        print(
            f"| {name} | {r['wall']:.1f} | {r['samples'] / r['wall']:.0f} | {base / r['wall']:.2f}x | "
            f"{r['trainer_busy']:.0%} | {r['inference_busy']:.0%} | {r['reward']:.3f} | {r['staleness']:.2f} |"
        )
    target = "2x" if args.gpu else "1.8x"  # the GPU's target is Step 7's, the CPU pipeline's Step 4's
    print(f"\ntarget: W=none >= {target} faster than W=1 with no loss in final reward")


if __name__ == "__main__":
    main()
