"""The calculator task learned from scratch, with the tool and without it, in one run on this machine.

    uv run python bench/calculator_curve.py [--minutes 15] [--recipe calculator-tiny-cpu] [--seeds 0 1 2]
        [--keep DIR]

Each run is a real `meshy run` of the recipe, one after the other (never side by side: they would
share the cores): `with the tool` as shipped, once per seed in --seeds (the recipe's `seed`: the model's
initial weights, the problems and the sampling), and `without the tool`, once, the same recipe, model,
first seed and budget with `environment_options.tool = false` (the same problems and the same reward for
answers, no calculator to call). A run ends at the recipe's `steps` or when `--minutes` have passed since its
`meshy run` started (start-up included), whichever comes first; a run stopped by the budget is stopped
as a user would stop it (SIGINT). The table gives, for each minute of the run, the mean reward of
the versions trained in it (the recipe's reward, partial credit included) and the share of its
trajectories that ended with exactly the right answer (reward 1.0), read from the run's own
metrics.jsonl and records/environment-*.jsonl. The runs are deleted afterwards unless `--keep DIR`
is given: then each stays in DIR/tool-{true,false}-seed-N (its records, checkpoints and logs), for
reading a run that did not reach the target.
"""

import argparse
import contextlib
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from meshy.recipes.recipe.catalog import resolve
from meshy.recipes.roles.context import RecordKind

TOOL, NO_TOOL = "true", "false"  # environment_options.tool
TARGET = 0.9  # the mean reward the recipe promises (issue 14: from chance to >= 0.9 in 15 minutes)
EXACT = 1.0 - 1e-6  # a trajectory's reward above this is an exact answer's (partial credit stays far below)
WINDOW = 20  # versions averaged for "reached": one lucky version is not a learned task


@dataclass(frozen=True)
class Curve:
    """A run's learning curve against wall time since its `meshy run` started."""

    versions: list[tuple[float, float]]  # (seconds, mean reward) per version
    trajectories: list[tuple[float, float]]  # (seconds, reward) per trajectory

    def reward(self, start: float, end: float) -> float | None:
        rewards = [r for t, r in self.versions if start < t <= end]
        return sum(rewards) / len(rewards) if rewards else None

    def exact(self, start: float, end: float) -> float | None:
        ends = [r > EXACT for t, r in self.trajectories if start < t <= end]
        return sum(ends) / len(ends) if ends else None

    def reached(self) -> float | None:
        """Seconds to the first version at which the last WINDOW versions' mean reward is >= TARGET."""
        for i in range(WINDOW, len(self.versions) + 1):
            if sum(r for _, r in self.versions[i - WINDOW : i]) / WINDOW >= TARGET:
                return self.versions[i - 1][0]
        return None


def recipe(directory: Path, source: Path, tool: str, seed: int) -> Path:
    text = source.read_text()
    text, runs = re.subn(r"^run_dir = .*$", f'run_dir = "{directory}"', text, count=1, flags=re.M)
    text, seeds = re.subn(r"^seed = .*$", f"seed = {seed}", text, count=1, flags=re.M)
    text, tools = re.subn(r"^environment_options = \{", f"environment_options = {{ tool = {tool},", text, flags=re.M)
    if runs != 1 or seeds != 1 or tools != 1:
        sys.exit(f"{source}: expected one run_dir, one seed and one [task] environment_options line to edit")
    path = directory / "recipe.toml"
    path.write_text(text)
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def kept_directories(keep: Path, runs: list[tuple[str, int]]) -> list[Path]:
    """A new directory in `keep` for each (tool, seed) run, made before any run starts (an existing one
    is refused: its run's records would mix with another's)."""
    directories = [keep / f"tool-{tool}-seed-{seed}" for tool, seed in runs]
    for directory in directories:
        try:
            directory.mkdir(parents=True)
        except FileExistsError:
            sys.exit(f"--keep: {directory} exists; give a directory this bench's runs are not in yet")
    return directories


@contextlib.contextmanager
def run_directory(kept: Path | None) -> Iterator[Path]:
    """Where a run's recipe and run directory go: `kept`, or a temporary directory deleted afterwards."""
    if kept is not None:
        yield kept
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def measure(source: Path, tool: str, seed: int, minutes: float, kept: Path | None) -> tuple[Curve, str]:
    """Run the recipe for at most `minutes` (in `kept`, if given); its curve, and how it ended."""
    with run_directory(kept) as directory:
        command = [sys.executable, "-m", "meshy.recipes.cli", "run", str(recipe(directory, source, tool, seed))]
        start = time.time()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = process.communicate(timeout=minutes * 60)
            ending = "finished its steps"
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=120)
            ending = f"stopped at {minutes:g} min"
        runs = [p for p in directory.iterdir() if p.is_dir()]
        if (ending == "finished its steps" and process.returncode != 0) or len(runs) != 1:
            sys.exit(f"tool = {tool}, seed = {seed}: meshy run failed ({process.returncode}):\n{stderr[-3000:]}")
        metrics = lines(runs[0] / "metrics.jsonl")
        trajectories = [
            (r["time"] - start, r["reward"])
            for path in sorted((runs[0] / "records").glob("environment-*.jsonl"))
            for r in lines(path)
            if r["kind"] == RecordKind.TRAJECTORY
        ]
        curve = Curve([(m["time"] - start, m["reward_mean"]) for m in metrics], sorted(trajectories))
        return curve, f"{ending}, {len(metrics)} versions"


def cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="calculator-tiny-cpu", help="a shipped recipe's name or a file")
    parser.add_argument("--minutes", type=float, default=15.0, help="wall-clock budget per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="the runs with the tool, one per seed")
    parser.add_argument("--keep", type=Path, help="keep each run in a new directory in this one")
    args = parser.parse_args()
    source = resolve(args.recipe)
    runs = {f"with the tool, seed {seed}": (TOOL, seed) for seed in args.seeds}
    runs[f"without the tool, seed {args.seeds[0]}"] = (NO_TOOL, args.seeds[0])
    kept = kept_directories(args.keep, list(runs.values())) if args.keep else [None] * len(runs)
    results = {
        label: measure(source, tool, seed, args.minutes, directory)
        for (label, (tool, seed)), directory in zip(runs.items(), kept, strict=True)
    }
    print(f"\n{source.stem}, from scratch, at most {args.minutes:g} minutes of `meshy run` per run\n")
    for label, (curve, ending) in results.items():
        reached = curve.reached()
        when = f"at {reached / 60:.1f} min" if reached else "never"
        print(f"{label}: {ending}; a mean reward of {TARGET} over {WINDOW} versions reached {when}")
    columns = [f"{kind} {label}" for label in runs for kind in ("reward", "exact")]
    print("\n| minute | " + " | ".join(columns) + " |")
    print("|" + "---|" * (len(columns) + 1))
    for minute in range(1, int(args.minutes + 0.999) + 1):
        window = (60.0 * (minute - 1), 60.0 * minute)
        row = [cell(f(*window)) for curve, _ in results.values() for f in (curve.reward, curve.exact)]
        print(f"| {minute} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
