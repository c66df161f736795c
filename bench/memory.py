"""Memory over a long run: each process's peak RSS after 1,000 and after 10,000 trained rows.

    uv run python bench/memory.py [--rows 10000]

A real `meshy run` of the embedded default recipe (256 rows per version), two versions longer than
`--rows`. An outside observer samples every role process and the data-plane servers (their pids come
from the run's own start records) and reads the kernel's high-water mark (VmHWM) when the trained rows
first reach 1,000 and when they first reach `--rows`; growth between the two is what a leak would show.
The data plane's logs on disk (rows kept for a resume, `durable`) are sampled the same way: their largest
size so far, which compaction bounds as rows retire. The run then ends on its own. Its teardown is not
measured: at exit each process's CUDA libraries (libcublasLt, libcusparseLt, ...; linked into torch even
on CPU) touch ~110 MiB of their own clean, shared file pages, which the high-water mark counts as RSS.
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshy.recipes.recipe import DEFAULT_RECIPE, load_recipe

EARLY_ROWS = 1000
MARGIN_VERSIONS = 2  # the run goes on past `rows`, so the last reading precedes its teardown


def rows_trained(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(m["rows_trained"] + m["rows_dropped"] for m in map(json.loads, path.read_text().splitlines()))


def processes(run_dir: Path) -> dict[str, int]:
    """name -> pid of every role process and data-plane server that has started."""
    found = {}
    for path in (run_dir / "records").glob("*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            if record["kind"] == "start":
                found[path.stem] = record["pid"]
                if record["dataplane"]:
                    found["dataplane-controller"] = record["dataplane"]["controller"]
                    for i, pid in enumerate(record["dataplane"]["storage"]):
                        found[f"dataplane-storage-{i}"] = pid
    return found


def peak_rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)  # absent once the process has exited
    return int(found.group(1)) / 1024 if found else None


def logs_mib(run_dir: Path) -> float:
    """The data plane's logs on disk now (meshy.recipes.launch.durable_rows), in MiB."""
    return sum(f.stat().st_size for f in (run_dir / "dataplane").rglob("*.log")) / 2**20


def measure(rows: int, workdir: Path) -> tuple[dict[str, tuple[float, float]], tuple[float, float]]:
    """name -> (peak RSS MiB at EARLY_ROWS trained rows, at `rows`); and the data plane's logs on disk, the
    most they took until each of the two (MiB)."""
    algo = load_recipe(DEFAULT_RECIPE).algorithm
    steps = -(-rows // (algo.prompts_per_step * algo.group_size)) + MARGIN_VERSIONS
    text = re.sub(r"^steps = .*$", f"steps = {steps}", DEFAULT_RECIPE.read_text(), flags=re.M)
    text = re.sub(r"^run_dir = .*$", f'run_dir = "{workdir}"', text, flags=re.M)
    text = re.sub(r"^checkpoint_every = .*$", "checkpoint_every = 0", text, flags=re.M)
    (workdir / "recipe.toml").write_text(text)
    run = subprocess.Popen(
        [sys.executable, "-m", "meshy.recipes.cli", "run", str(workdir / "recipe.toml")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    early: dict[str, float] = {}
    late: dict[str, float] = {}
    latest: dict[str, float] = {}
    disk = early_disk = 0.0
    run_dir = None
    while run.poll() is None:
        time.sleep(0.2)
        run_dir = run_dir or next((p for p in workdir.iterdir() if p.is_dir()), None)
        if run_dir is None or late:
            continue
        trained = rows_trained(run_dir)  # read before the peaks: they are then at least this late
        for name, pid in processes(run_dir).items():
            peak = peak_rss_mib(pid)
            if peak is not None:
                latest[name] = peak
        disk = max(disk, logs_mib(run_dir))
        if not early and trained >= EARLY_ROWS:
            early, early_disk = dict(latest), disk
        if trained >= rows:
            late = dict(latest)
    stderr = run.stderr.read()
    if run.returncode != 0 or not late:
        raise RuntimeError(f"the run failed (exit {run.returncode}): {stderr[-3000:]}")
    return {name: (early[name], late[name]) for name in sorted(early)}, (early_disk, disk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshy-memory-") as workdir:
        peaks, (early_disk, late_disk) = measure(args.rows, Path(workdir))
    print(f"peak RSS (MiB) per process, default recipe, {EARLY_ROWS:,} vs {args.rows:,} trained rows")
    print(f"| process | at {EARLY_ROWS:,} rows | at {args.rows:,} rows | growth |")
    print("|---|---|---|---|")
    for name, (early, late) in peaks.items():
        print(f"| {name} | {early:.0f} | {late:.0f} | {100 * (late - early) / early:+.1f}% |")
    print(f"| data-plane logs on disk, the most so far | {early_disk:.1f} | {late_disk:.1f} | |")


if __name__ == "__main__":
    main()
