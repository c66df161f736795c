"""What a killed process costs a run: wall-clock lost, versions redone, trained tokens thrown away.

    uv run python bench/resume_loss.py [--steps 60] [--checkpoint-every 10] [--seed 0] [--durable off batched]
                                       [--pacing 1] [--recipe NAME] [--set FIELD=VALUE ...]

Each row is a real `meshy run` of the embedded default recipe (tiny Qwen3, arithmetic, GRPO, W=1; or
--recipe, changed by --pacing and --set) in which one process is SIGKILLed at a version drawn at random
from the middle third of the run (--seed), then resumed with `meshy run --resume` if it stopped; the first
row is the same run left alone. The kills: the data-plane host's controller (a), the inference process,
stopping the run or restarted in place (`[roles.inference] max_restarts = 1`) (b), training rank 0 (c),
and restarted in place, the rollout process (d) and a multi-turn recipe's environment process (e). Wall
is from launch to the end of the last run, lost is its excess over the undisturbed run.
Versions redone are those the killed run had trained past the checkpoint it resumed from; their training
was thrown away, and their rows generated again unless kept on disk (then counted in the kept column as
trained again). What an engine restarted in place had generated and not yet
written (its rows in flight) is generated again too (unless `sampling.keep_partial_every` kept it in
chunks), and not counted here. Each set of kills runs once per `--durable` mode ([dataplane] durable):
with rows on disk, a resumed run keeps the generated rows it can still use (counted from its kept-rows
record) and drops the rest (generated again); with rows in memory only, every row generated and not yet
trained at the kill is lost (as many as a run with rows on disk keeps and drops).
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshy.train import checkpoint

COMMAND = [sys.executable, "-m", "meshy.recipes.cli", "run"]
KILLS = {
    "none": None,
    "(a) data plane, stop + resume": ("dataplane", 0),
    "(b) inference, stop + resume": ("inference-0", 0),
    "(b) inference, restarted in place": ("inference-0", 1),
    "(c) training rank 0, stop + resume": ("training-0", 0),
    "(d) rollout, restarted in place": ("rollout-0", 1),
    "(e) environment, restarted in place": ("environment-0", 1),  # a multi-turn recipe's (--recipe calculator-...)
}
SINGLE_TURN_KILLS = [name for name, kill in KILLS.items() if kill is None or not kill[0].startswith("environment")]


def records(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "records" / f"{name}.jsonl").read_text().splitlines()]


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def victim(run_dir: Path, target: str) -> int:
    """The pid to kill: the controller's, or a role process's (a restartable one's child)."""
    if target == "dataplane":
        start = next(r for r in records(run_dir, "training-0") if r["kind"] == "start")
        return int(start["dataplane"]["controller"])
    starts = [r for r in records(run_dir, target) if r["kind"] == "start"]
    return int(starts[-1]["pid"])


def wait_for_version(run: subprocess.Popen, root: Path, version: int) -> Path:
    """The run's directory, once it has trained `version` versions."""
    while run.poll() is None:
        found = next(root.glob("*/metrics.jsonl"), None)
        if found is not None and len(metrics(found.parent)) >= version:
            return found.parent
        time.sleep(0.05)
    sys.exit(f"the run ended before version {version}")


def kept_rows(run_dir: Path) -> dict | None:
    """The resumed run's record of the rows it kept from disk (rank 0's), if any."""
    found = [r for path in (run_dir / "records").glob("*.jsonl") for r in records(run_dir, path.stem)]
    kept = [r for r in found if r["kind"] == "kept_rows"]
    return kept[-1] if kept else None


def _kept(kept: dict | None) -> str:
    """Generated tokens a resume kept: of whole responses, and of responses in progress (keep_partial_every)."""
    if kept is None:
        return ""
    retrained = kept.get("retrained", {}).get("rows")
    text = f"{kept['kept']['tokens']} ({kept['kept']['rows']} rows" + (
        f", {retrained} trained again)" if retrained else ")"
    )
    partial = kept["partial"]
    return text + (f" + {partial['tokens']} of {partial['rows']} in progress" if partial["rows"] else "")


def measure(name: str, kill_at: int, durable: str, args: argparse.Namespace) -> dict:
    kill = KILLS[name]
    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"steps={args.steps}", f'run_dir="{tmp}"', f"checkpoint_every={args.checkpoint_every}"]
        sets += [f'dataplane.durable="{durable}"', *args.set]
        sets += [f"algorithm.pacing={args.pacing}"] if args.pacing else []
        if kill is not None and kill[1]:
            sets.append(f"roles.{kill[0].rsplit('-', 1)[0]}.max_restarts={kill[1]}")
        started = time.monotonic()
        run = subprocess.Popen(
            COMMAND + ([args.recipe] if args.recipe else []) + [a for s in sets for a in ("--set", s)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        redone = thrown = 0
        kept = None
        if kill is not None:
            run_dir = wait_for_version(run, Path(tmp), kill_at)
            if kill[1]:  # restarting in place: the child running the role, once it has started
                while not any(r.get("attempt") == 0 for r in records(run_dir, kill[0]) if r["kind"] == "start"):
                    time.sleep(0.05)
            os.kill(victim(run_dir, kill[0]), signal.SIGKILL)
        _, stderr = run.communicate()
        (run_dir,) = [p for p in Path(tmp).iterdir() if p.is_dir()]
        if run.returncode != 0:
            if kill is None or kill[1]:
                sys.exit(f"{name}: the run failed\n{stderr[-3000:]}")
            restored = checkpoint.step_of(checkpoint.latest(run_dir / "checkpoints"))
            lost = [m for m in metrics(run_dir) if m["version"] > restored]
            resumed = subprocess.run([*COMMAND, "--resume", str(run_dir)], capture_output=True, text=True)
            if resumed.returncode != 0:
                sys.exit(f"{name}: the resume failed\n{resumed.stderr[-3000:]}")
            redone, thrown = len(lost), sum(m["tokens"] for m in lost)
            kept = kept_rows(run_dir)
        wall = time.monotonic() - started
        final = metrics(run_dir)
        assert [m["version"] for m in final] == list(range(1, args.steps + 1)), f"{name}: versions 1..N"
        rows = [r for m in final for r in m["row_ids"]] + [d["row"] for m in final for d in m["dropped"]]
        assert len(rows) == len(set(rows)), f"{name}: a row trained twice"
        dropped = sum(d["tokens"] for d in kept["dropped"].values()) if kept else 0
        continued = ""
        if kill is not None and kill[1] and kill[0].startswith("inference"):  # what its new engine continued
            engine = [r for r in records(run_dir, kill[0]) if r["kind"] == "inference"][-1]
            if engine["resumed_rows"]:
                continued = f"{engine['resumed_tokens']} of {engine['resumed_rows']} in progress, continued"
        return {
            "name": name,
            "durable": durable,
            "kept": _kept(kept) or continued,
            "dropped": f"{dropped} ({sum(d['rows'] for d in kept['dropped'].values())} rows)" if kept else "",
            "kill_at": kill_at if kill else None,
            "wall": wall,
            "redone": redone,
            "thrown": thrown,
            "tokens": sum(m["tokens"] for m in final),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="draws the version each kill comes after")
    parser.add_argument("--kills", nargs="+", default=SINGLE_TURN_KILLS, choices=list(KILLS))
    parser.add_argument("--durable", nargs="+", default=["off", "batched"], choices=["off", "batched", "sync"])
    parser.add_argument("--pacing", help="algorithm.pacing: 1, 2, ... or '\"none\"' (default: the recipe's)")
    parser.add_argument("--recipe", default=None, help="a shipped recipe's name or a path (default: the embedded one)")
    parser.add_argument("--set", action="append", default=[], help="a recipe field, FIELD=VALUE (as meshy run --set)")
    args = parser.parse_args()
    draw = random.Random(args.seed)
    draws = [draw.randint(args.steps // 3, 2 * args.steps // 3) for _ in args.kills]
    kills = list(zip(args.kills, draws, strict=True))
    rows = [measure(name, at, durable, args) for durable in args.durable for name, at in kills]
    recipe = args.recipe or "default recipe"
    pacing = f"pacing {args.pacing}" if args.pacing else "its own pacing"
    print(f"\n{recipe}, {args.steps} versions, {pacing}, checkpoint every {args.checkpoint_every}")
    print(f"seed {args.seed}" + "".join(f", {s}" for s in args.set) + "\n")
    print(
        "| kill | rows on disk | after version | wall s | lost s | versions redone | trained tokens thrown away "
        "| generated tokens kept at resume | generated tokens dropped at resume |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next((b["wall"] for b in rows if b["name"] == "none" and b["durable"] == r["durable"]), None)
        lost = f"{r['wall'] - base:+.1f}" if base is not None and r["name"] != "none" else ""
        share = f"{r['thrown']} ({100 * r['thrown'] / r['tokens']:.1f}% of the run's)" if r["redone"] else "0"
        print(
            f"| {r['name']} | {r['durable']} | {r['kill_at'] or ''} | {r['wall']:.1f} | {lost} | {r['redone']} "
            f"| {share} | {r['kept']} | {r['dropped']} |"
        )


if __name__ == "__main__":
    main()
