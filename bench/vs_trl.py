"""Meshy and Hugging Face TRL side by side on one job, in one run on this machine.

    uv run python bench/vs_trl.py --job default|smollm2 [--recipe PATH] [--seeds 0] [--threads 2]
        [--pacings 1 none] [--steps N] [--keep DIR]

For each seed, one run after the other (never side by side: they would share the cores): TRL's GRPOTrainer
(bench/trl_grpo.py, on-policy) and then a `meshy run` at each pacing in --pacings, of the same recipe, seed
and steps. Job `default` is the embedded default recipe (tiny Qwen3 from scratch, single-digit addition);
job `smollm2` is --recipe, by default the shipped smollm2-135m-arithmetic-cpu (SmolLM2-135M-Instruct's real
weights on reasoning-gym's chain_sum, with held-out evaluation). Meshy runs a copy of the recipe with
run_dir, seed, steps and algorithm.pacing changed, checkpoint_every = 0 (TRL saves nothing either) and
`threads = --threads` in every [roles.*] section; TRL runs with torch.set_num_threads(--threads): each
process computes with that many threads.

Measured from outside, for every run, from its launch (just before the subprocess starts):
- start-up: seconds to the end of the first trained version (Meshy: metrics.jsonl's unix `time`; TRL:
  steps.jsonl's `time`, seconds since its script started, placed by the script's own start time);
- the training reward of each version and the held-out accuracy of each evaluated version (Meshy: its
  eval role's lines in metrics.jsonl; TRL: its evaluation callback's), an evaluated version counted at the
  time it was trained (Meshy's version 0: when its evaluation started);
- steady samples/s: rows trained per second after the first 10% of versions; total s: launch to exit;
- peak PSS: the most memory the run's whole process tree held (PSS summed over the launched process and
  every descendant, from /proc, sampled every 0.5 s);
- the target: job default, the first version at which the mean training reward of the last 20 versions
  is >= 0.9 (seconds since launch, and versions); job smollm2, the first evaluated version whose held-out
  accuracy reaches TRL's final one for that seed.
TRL's held-out evaluation and its equivalence checks run in its training process and are taken off its
clock (its times and total s exclude them, as TRL's training does not do them); Meshy's eval role runs
beside training in a process of its own, sharing the cores, and nothing is taken off Meshy's clock.
The runs are deleted afterwards unless `--keep DIR` is given: then each stays in DIR/<side>-pacing-P-seed-S.
"""

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from calculator_curve import cell, lines
from trl_grpo import TARGET, WINDOW, steps_to_target

from meshy.recipes.recipe import DEFAULT_RECIPE, CustomRoleSpec, load_recipe
from meshy.recipes.recipe.catalog import shipped

BENCH = Path(__file__).resolve().parent
SMOLLM2_RECIPE = shipped()["smollm2-135m-arithmetic-cpu"]
SAMPLE_S = 0.5  # PSS sampling period
WARM_UP = 0.1  # the share of versions left out of the steady rate
BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True)
class Run:
    side: str  # "TRL" or "Meshy"
    pacing: str  # Meshy's algorithm.pacing; TRL is on-policy, "1"
    seed: int

    @property
    def name(self) -> str:
        return f"{self.side.lower()}-pacing-{self.pacing}-seed-{self.seed}"

    @property
    def label(self) -> str:
        return "TRL" if self.side == "TRL" else f"Meshy W={self.pacing}"


@dataclass(frozen=True)
class Version:
    seconds: float  # since launch, at the end of its training step
    reward: float  # its mean training reward
    rows: int  # rows trained into it


@dataclass(frozen=True)
class Evaluated:
    version: int
    seconds: float  # since launch, when the version was trained
    accuracy: float


@dataclass(frozen=True)
class Result:
    run: Run
    versions: list[Version]
    evals: list[Evaluated]
    total_s: float
    peak_pss: int  # bytes


# ---- the recipe copy Meshy runs ---------------------------------------------------------------------------
def toml_key(key: str) -> str:
    return key if BARE_KEY.fullmatch(key) else json.dumps(key)


def toml_value(value) -> str:
    """`value` as inline TOML (tables as inline tables); JSON's string escapes are TOML's."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {type(value).__name__} {value!r}")


def toml_text(data: dict) -> str:
    """`data` as TOML: top-level tables as [sections], everything inside them inline; checked by parsing."""
    scalars = [f"{toml_key(k)} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    tables = [
        f"\n[{toml_key(k)}]\n" + "".join(f"{toml_key(kk)} = {toml_value(vv)}\n" for kk, vv in v.items())
        for k, v in data.items()
        if isinstance(v, dict)
    ]
    text = "\n".join(scalars) + "\n" + "".join(tables)
    assert tomllib.loads(text) == data, "the TOML writer lost something"
    return text


def meshy_recipe(source: Path, directory: Path, seed: int, steps: int, pacing: str, threads: int) -> Path:
    """The recipe Meshy runs: `source` with run_dir, seed, steps, algorithm.pacing, checkpoint_every = 0 and
    `threads` in every role's section (sections added for roles the recipe leaves to their defaults)."""
    data = tomllib.loads(source.read_text(encoding="utf-8"))
    data |= {"run_dir": str(directory), "seed": seed, "steps": steps, "checkpoint_every": 0}
    data.setdefault("algorithm", {})["pacing"] = pacing if pacing == "none" else int(pacing)
    roles = data.setdefault("roles", {})
    for name, spec in load_recipe(source).roles.items():  # every role, the eval role an [eval] adds included
        if not isinstance(spec, CustomRoleSpec):
            roles.setdefault(name, {})["threads"] = threads
    for custom in roles.get("custom", []):
        custom["threads"] = threads
    path = directory / "recipe.toml"
    path.write_text(toml_text(data), encoding="utf-8")
    load_recipe(path)  # refused here, naming the field, rather than in the run
    return path


# ---- measuring a run from outside -------------------------------------------------------------------------
def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it, from /proc's parent ids."""
    children = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            children[int(stat.read_text().rsplit(")", 1)[1].split()[1])].append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children[pid]
    return tree


def pss_bytes(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:  # gone, or not ours to read
        return 0
    found = re.search(r"^Pss:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) * 1024 if found else 0


class PeakPss:
    """The peak PSS of a process tree, summed over the tree, sampled every SAMPLE_S seconds from a thread."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-pss", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, sum(pss_bytes(pid) for pid in process_tree(self.pid)))
            if self._done.wait(SAMPLE_S):
                return

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def launch(command: list[str], directory: Path) -> tuple[float, float, int]:
    """Run `command` (output to directory/output.log) to its end: (launch unix time, seconds to exit, peak
    PSS bytes). A bench stopped meanwhile stops it as a user would (SIGINT), then waits for it."""
    with (directory / "output.log").open("w") as log:
        start = time.time()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        sampler = PeakPss(process.pid)
        try:
            returncode = process.wait()
            wall = time.time() - start
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                process.wait(timeout=120)
            peak = sampler.stop()
    if returncode != 0:
        tail = (directory / "output.log").read_text(errors="replace")[-3000:]
        sys.exit(f"{shlex.join(command)} failed ({returncode}):\n{tail}")
    return start, wall, peak


def run_trl(run: Run, job_args: list[str], steps: int, threads: int, directory: Path) -> Result:
    command = [sys.executable, str(BENCH / "trl_grpo.py"), *job_args, "--seed", str(run.seed), "--steps", str(steps)]
    start, wall, peak = launch([*command, "--threads", str(threads), "--out", str(directory)], directory)
    summary = json.loads((directory / "summary.json").read_text())
    offset = summary["t0_unix"] - start  # its clock starts with its script, just after launch
    steps_lines = lines(directory / "steps.jsonl")
    versions = [Version(offset + s["time"], s["reward_mean"], s["samples"]) for s in steps_lines if "reward_mean" in s]
    evals = [Evaluated(s["step"], offset + s["time"], s["eval/accuracy"]) for s in steps_lines if "eval/accuracy" in s]
    return Result(run, versions, evals, wall - sum(summary["excluded_s"].values()), peak)


def run_meshy(run: Run, source: Path, steps: int, threads: int, directory: Path) -> Result:
    recipe = meshy_recipe(source, directory, run.seed, steps, run.pacing, threads)
    start, wall, peak = launch([sys.executable, "-m", "meshy.recipes.cli", "run", str(recipe)], directory)
    (run_dir,) = [p for p in directory.iterdir() if p.is_dir()]
    metrics = lines(run_dir / "metrics.jsonl")
    trained = [m for m in metrics if "eval/accuracy" not in m]
    versions = [Version(m["time"] - start, m["reward_mean"], m["rows_trained"]) for m in trained]
    ends = {m["version"]: m["time"] - start for m in trained}
    evals = [
        Evaluated(m["version"], ends.get(m["version"], m["time"] - m["eval/seconds"] - start), m["eval/accuracy"])
        for m in metrics
        if "eval/accuracy" in m
    ]
    return Result(run, versions, sorted(evals, key=lambda e: e.version), wall, peak)


# ---- figures ----------------------------------------------------------------------------------------------
def steady_rate(versions: list[Version]) -> float | None:
    """Rows trained per second after the first WARM_UP share of versions (timed from the end of the last
    one left out)."""
    steady = versions[max(1, math.ceil(len(versions) * WARM_UP)) - 1 :]
    if len(steady) < 2:
        return None
    return sum(v.rows for v in steady[1:]) / (steady[-1].seconds - steady[0].seconds)


def reward_target(result: Result) -> tuple[float, int] | None:
    """(seconds, versions) to the first version whose last-WINDOW mean training reward is >= TARGET."""
    n = steps_to_target([v.reward for v in result.versions])
    return None if n is None else (result.versions[n - 1].seconds, n)


def accuracy_target(result: Result, target: float) -> tuple[float, int] | None:
    """(seconds, version) of the first evaluated version whose held-out accuracy is >= target."""
    return next(((e.seconds, e.version) for e in result.evals if e.accuracy >= target), None)


def last_mean(versions: list[Version]) -> float | None:
    recent = [v.reward for v in versions[-WINDOW:]]
    return sum(recent) / len(recent) if recent else None


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(columns: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def summary_rows(results: list[Result], job: str) -> list[list[str]]:
    rows = []
    for r in results:
        if job == "default":
            reached = reward_target(r)
        else:
            trl = next(t for t in results if t.run.side == "TRL" and t.run.seed == r.run.seed)
            reached = accuracy_target(r, trl.evals[-1].accuracy) if trl.evals else None
        rows.append(
            [
                r.run.side,
                r.run.pacing,
                str(r.run.seed),
                fmt(r.versions[0].seconds if r.versions else None, ".1f"),
                fmt(reached[0] if reached else None, ".1f"),
                fmt(reached[1] if reached else None, "d"),
                cell(r.evals[-1].accuracy if r.evals else None),
                cell(last_mean(r.versions)),
                fmt(steady_rate(r.versions), ".1f"),
                fmt(r.peak_pss / 2**30, ".2f"),
                fmt(r.total_s, ".1f"),
            ]
        )
    return rows


def accuracy_by(result: Result, seconds: float) -> float | None:
    """The held-out accuracy of the last evaluated version trained by `seconds`."""
    done = [e for e in result.evals if e.seconds <= seconds]
    return max(done, key=lambda e: e.version).accuracy if done else None


def reward_within(result: Result, start: float, end: float) -> float | None:
    rewards = [v.reward for v in result.versions if start < v.seconds <= end]
    return sum(rewards) / len(rewards) if rewards else None


def by_minute(results: list[Result], evaluated: bool) -> None:
    minutes = math.ceil(max(r.total_s for r in results) / 60)
    columns = ["minute"]
    for r in results:
        columns += ([f"accuracy {r.run.label}"] if evaluated else []) + [f"reward {r.run.label}"]
    rows = []
    for minute in range(1, minutes + 1):
        row = [str(minute)]
        for r in results:
            row += [cell(accuracy_by(r, 60.0 * minute))] if evaluated else []
            row.append(cell(reward_within(r, 60.0 * (minute - 1), 60.0 * minute)))
        rows.append(row)
    table(columns, rows)


# ---- the bench --------------------------------------------------------------------------------------------
def machine() -> str:
    models = re.findall(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{models[0] if models else 'unknown CPU'}, {os.cpu_count()} cores (load average at start {load})"


@contextlib.contextmanager
def runs_root(keep: Path | None, runs: list[Run]) -> Iterator[Path]:
    """Where the runs go: --keep (each run's directory made before any run starts; an existing one is
    refused), or a temporary directory deleted afterwards."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
            for run in runs:
                (Path(tmp) / run.name).mkdir()
            yield Path(tmp)
        return
    for run in runs:
        try:
            (keep / run.name).mkdir(parents=True)
        except FileExistsError:
            sys.exit(f"--keep: {keep / run.name} exists; give a directory this bench's runs are not in yet")
    yield keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=("default", "smollm2"), required=True)
    parser.add_argument("--recipe", type=Path, help=f"job smollm2: the recipe (default {SMOLLM2_RECIPE})")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each process, both sides")
    parser.add_argument("--pacings", nargs="+", default=["1", "none"], help='Meshy\'s algorithm.pacing: k or "none"')
    parser.add_argument("--steps", type=int, help="versions to train (default: the recipe's)")
    parser.add_argument("--keep", type=Path, help="keep each run in a new directory in this one")
    args = parser.parse_args()
    if args.job == "default" and args.recipe is not None:
        parser.error("--recipe goes with --job smollm2")
    for pacing in args.pacings:
        if pacing != "none" and not (pacing.isdigit() and int(pacing) >= 1):
            parser.error(f'--pacings: expected integers >= 1 or "none", got {pacing!r}')
    source = DEFAULT_RECIPE if args.job == "default" else (args.recipe or SMOLLM2_RECIPE)
    job_args = ["--job", "default"] if args.job == "default" else ["--job", "recipe", "--recipe", str(source)]
    steps = args.steps or load_recipe(source).steps
    runs = [Run(side, p, s) for s in args.seeds for side, p in [("TRL", "1")] + [("Meshy", p) for p in args.pacings]]

    results = []
    with runs_root(args.keep, runs) as root:
        print(f"machine: {machine()}\ndate: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
        print(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}\nrecipe: {source}, {steps} versions\n")
        for run in runs:
            print(f"running {run.label}, seed {run.seed} ...", file=sys.stderr, flush=True)
            directory = root / run.name
            if run.side == "TRL":
                results.append(run_trl(run, job_args, steps, args.threads, directory))
            else:
                results.append(run_meshy(run, source, steps, args.threads, directory))

    target = (
        f"a mean training reward >= {TARGET} over the last {WINDOW} versions"
        if args.job == "default"
        else "the held-out accuracy of TRL's final version (same seed)"
    )
    print(f"target: {target}\n")
    columns = [
        "side",
        "pacing",
        "seed",
        "start-up s",
        "time to target s",
        "versions to target",
        "final held-out accuracy",
        f"last-{WINDOW} reward",
        "steady samples/s",
        "peak PSS GB",
        "total s",
    ]
    table(columns, summary_rows(results, args.job))
    for seed in args.seeds:
        evaluated = args.job != "default"
        accuracy = "held-out accuracy of the last version evaluated by then, " if evaluated else ""
        print(f"\nseed {seed}, by minute since launch: {accuracy}mean training reward of the versions trained in it\n")
        by_minute([r for r in results if r.run.seed == seed], evaluated)


if __name__ == "__main__":
    main()
