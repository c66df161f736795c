"""A learning-tier run that is stopped once it has shown what it promises: `meshy run` in a child process,
its metrics read as they are written, SIGTERM once a window of versions averages the target reward (the
versions after it are not asserted), so the tier costs the rise, not the whole recipe."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

WINDOW = 20  # versions averaged: one lucky version is not a learned task


def metrics_of(run_parent: Path) -> list[dict]:
    """The metrics lines written so far by the one run under `run_parent` (none before its directory exists;
    a line being written is left out)."""
    run_dirs = [p for p in run_parent.iterdir() if p.is_dir()] if run_parent.is_dir() else []
    if not run_dirs or not (run_dirs[0] / "metrics.jsonl").exists():
        return []
    return [json.loads(line) for line in (run_dirs[0] / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]


def first_reached(rewards: list[float], target: float) -> int | None:
    """The first version whose window of WINDOW versions averages `target` or more."""
    return next((i for i in range(len(rewards) - WINDOW + 1) if sum(rewards[i : i + WINDOW]) / WINDOW >= target), None)


def run_until_learned(
    recipe: str | Path, run_parent: Path, target: float, timeout_s: float, log: Path, **popen
) -> list[dict]:
    """`meshy run RECIPE` (its runs under `run_parent`), stopped once `target` is reached or after timeout_s;
    its metrics lines. Its output goes to `log`; `popen`: the child's cwd, env."""
    command = [sys.executable, "-m", "meshy.recipes.cli", "run", str(recipe)]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, **popen)
        deadline = time.monotonic() + timeout_s
        try:
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(5)
                if first_reached([m["reward_mean"] for m in metrics_of(run_parent)], target) is not None:
                    process.send_signal(signal.SIGTERM)
                    break
            process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
    return metrics_of(run_parent)
