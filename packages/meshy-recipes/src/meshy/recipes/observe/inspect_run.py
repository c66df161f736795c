"""`meshy inspect RUN_DIR`: the control-stream audit and the staleness histogram, from a run's records;
for a multi-turn run also its trajectories (turns, finish reasons) and tool calls (by name, errors by
kind, latency); each GPU token ring's grants and its members' turns (overlapping ones counted: members
computing at once); and the bytes moved between each node's processes and each node's storage units."""

import itertools
import json
import statistics
from collections import Counter
from pathlib import Path

from meshy.dataplane import SchemaError, SequenceAudit
from meshy.recipes.roles.context import TRAFFIC_DIR

TASK_ERRORS_SHOWN = 10  # the most frequent task errors `meshy inspect` lists one by one


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _audit(sequence: list[int]) -> SequenceAudit:
    audit = SequenceAudit()
    for value in sequence:
        audit.observe(value)
    return audit


def report(run_dir: str | Path) -> str:
    run_dir = Path(run_dir)
    lines = _lines(run_dir / "metrics.jsonl")
    metrics = [m for m in lines if "eval/accuracy" not in m]  # a line per trained version
    evals = [m for m in lines if "eval/accuracy" in m]  # a line per evaluated version
    if not lines and not (run_dir / "records").is_dir():
        raise SchemaError(f"inspect: {run_dir} has no metrics.jsonl and no records/; is it a run directory?")
    out = [f"run {run_dir}"]
    versions = [m["version"] for m in metrics]
    trained = _audit(versions)
    out.append(
        f"weights versions trained and published: {len(versions)}"
        + (f" (v{versions[0]}..v{versions[-1]})" if versions else "")
        + f"  gaps {trained.gaps}  duplicates {trained.duplicates}  reordered {trained.reordered}"
    )
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        records = _lines(path)
        loaded = [v for r in records if r["kind"] == "inference" for v in r["versions"]]
        if any(r["kind"] == "inference" for r in records):
            audit = _audit(loaded)
            out.append(
                f"{path.stem}: loaded {len(loaded)} versions {loaded[:3]}{'...' if len(loaded) > 3 else ''}"
                f"  skipped {sum(b - a + 1 for a, b in audit.gaps)}  duplicates {audit.duplicates}"
                f"  reordered {audit.reordered}"
            )
    grants = sorted(
        (r["seq"], r["ring"], r["holder"])
        for p in (run_dir / "records").glob("*.jsonl")
        for r in _lines(p)
        if r["kind"] == "grant"
    )
    turns = [
        (r["ring"], r["start"], r["end"])
        for p in (run_dir / "records").glob("*.jsonl")
        for r in _lines(p)
        if r["kind"] == "device_turn"
    ]
    for ring in sorted({g[1] for g in grants}):
        seqs = [seq for seq, name, _ in grants if name == ring]
        audit = _audit(seqs)
        holders = Counter(holder for _, name, holder in grants if name == ring)
        spans = sorted((start, end) for name, start, end in turns if name == ring)
        overlapping = sum(before[1] > after[0] for before, after in itertools.pairwise(spans))
        out.append(
            f"ring {ring}: {len(seqs)} grants {dict(holders)}  gaps {audit.gaps}  duplicates {audit.duplicates}"
            f"  reordered {audit.reordered}  turns {len(spans)}, overlapping {overlapping}"
        )
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        lines = _lines(path)
        free = [r["free"] for r in lines if r["kind"] == "grant" and r.get("free") is not None]
        if free:
            out.append(f"{path.stem}: got its GPU {len(free)} times, finding at least {min(free) / 2**30:.2f} GiB free")
        released = [r for r in lines if r["kind"] == "released"]
        if released:
            most = max(r["reserved"] for r in released) / 2**20
            out.append(
                f"{path.stem}: handed its GPU over {len(released)} times, keeping at most {most:.0f} MiB reserved"
            )
    histogram: Counter = Counter()
    for m in metrics:
        histogram.update(m.get("staleness_histogram", {}))
    total = sum(histogram.values())
    out.append(
        "staleness of policy tokens as they reached training (versions behind; max_staleness masks older ones): "
        + (
            ", ".join(
                f"{k}: {v} ({v / total:.1%})"
                for k, v in sorted(histogram.items(), key=lambda kv: int(kv[0].lstrip(">=")))
            )
            if total
            else "no policy tokens reached training"
        )
    )
    reasons = Counter(d["reason"] for m in metrics for d in m.get("dropped", []))
    trained_rows = sum(m.get("rows_trained", 0) for m in metrics)
    out.append(
        f"rows trained {trained_rows}, dropped {sum(reasons.values())}"
        + "".join(f"\n  dropped: {n} x {reason}" for reason, n in reasons.most_common())
    )
    out += _task_errors(run_dir)
    out += _trajectories(run_dir)
    out += _traffic(run_dir)
    rewards = [m["reward_mean"] for m in metrics if m.get("reward_mean") is not None]
    if rewards:
        out.append(f"mean reward: first {rewards[0]:.3f}, last {rewards[-1]:.3f}, best {max(rewards):.3f}")
    out += _evaluations(run_dir, evals)
    return "\n".join(out)


def _evaluations(run_dir: Path, evals: list[dict]) -> list[str]:
    """The held-out accuracy's curve: its first, best and last evaluated versions (and pass@k's)."""
    if not evals:
        return []
    skipped = sum(r["kind"] == "eval_skipped" for p in (run_dir / "records").glob("eval-*.jsonl") for r in _lines(p))
    out = []
    for key in ["eval/accuracy", *sorted({k for m in evals for k in m if k.startswith("eval/pass@")})]:
        points = [(m["version"], m[key]) for m in evals if key in m]
        best = max(points, key=lambda p: p[1])
        out.append(
            f"held-out {key[5:]} ({evals[0]['eval/problems']} problems, {len(points)} versions evaluated"
            f"{f', {skipped} overtaken' if skipped else ''}): first v{points[0][0]} {points[0][1]:.3f}, "
            f"best v{best[0]} {best[1]:.3f}, last v{points[-1][0]} {points[-1][1]:.3f}"
        )
    return out


def _traffic(run_dir: Path) -> list[str]:
    """The bytes the processes' data-plane clients moved, by the client's node and the storage unit's
    (every run of a resumed run counted)."""
    moved: Counter = Counter()
    for path in (run_dir / "records" / TRAFFIC_DIR).glob("*.jsonl"):
        for line in _lines(path):
            for unit, storage_node in enumerate(line["storage_nodes"]):
                moved[(line["node"], storage_node, "sent")] += line["sent"][unit]
                moved[(line["node"], storage_node, "received")] += line["received"][unit]
    pairs = sorted({(client, storage) for client, storage, _ in moved})
    if not pairs:
        return []
    out = ["data-plane bytes, processes on node -> storage units on node: sent (writes), received (reads)"]
    for client, storage in pairs:
        sent, received = moved[(client, storage, "sent")], moved[(client, storage, "received")]
        out.append(f"  node {client} -> node {storage}: sent {_size(sent)}, received {_size(received)}")
    return out


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def _task_errors(run_dir: Path) -> list[str]:
    """What the task's code failed on in a run that drops such rows (on_task_error = "drop"): rows dropped,
    problems skipped, by error."""
    lines = [r for p in (run_dir / "records").glob("rollout-*.jsonl") for r in _lines(p)]
    records = [r for r in lines if r["kind"] == "task_errors"]
    if not records:
        return []
    errors: Counter = Counter()
    for r in records:
        errors.update(r["errors"])
    rows = sum(len(r["rows"]) for r in records)
    skipped = sum(not r["rows"] for r in records)
    shown = errors.most_common(TASK_ERRORS_SHOWN)
    rest = errors.total() - sum(n for _, n in shown)
    return [
        f"task errors (on_task_error = drop): {rows} rows dropped by rollout (training counts those it reached "
        f"before the run ended), {skipped} problems skipped"
        + "".join(f"\n  {n} x {error}" for error, n in shown)
        + (f"\n  {rest} x {len(errors) - len(shown)} other errors" if rest else "")
    ]


def _trajectories(run_dir: Path) -> list[str]:
    """The environment role's trajectories: one per rollout row, the last played (a resumed run plays
    again the rows its checkpoint had not trained)."""
    records = [r for path in (run_dir / "records").glob("environment-*.jsonl") for r in _lines(path)]
    played = {r["row"]: r for r in sorted(records, key=lambda r: r["time"]) if r["kind"] == "trajectory"}
    if not played:
        return []
    trajectories = list(played.values())
    turns = Counter(t["turns"] for t in trajectories)
    reasons = Counter(t["finish_reason"] for t in trajectories)
    calls, errors = Counter(), Counter()
    for t in trajectories:
        calls.update(t["tool_calls"])
        errors.update(t["tool_errors"])
    seconds = sorted(s for t in trajectories for s in t["tool_seconds"])
    out = [
        f"trajectories {len(trajectories)}: turns "
        + ", ".join(f"{k}: {n}" for k, n in sorted(turns.items()))
        + f" (mean {statistics.fmean(t['turns'] for t in trajectories):.2f}); finished "
        + ", ".join(f"{reason} {n}" for reason, n in reasons.most_common()),
        f"tool calls {sum(calls.values())}"
        + "".join(f", {name or '(malformed)'} {n}" for name, n in calls.most_common())
        + "; errors "
        + (", ".join(f"{kind} {n}" for kind, n in errors.most_common()) if errors else "none"),
    ]
    if seconds:
        p95 = seconds[min(len(seconds) - 1, int(0.95 * len(seconds)))]
        out.append(f"tool latency: median {statistics.median(seconds):.3f} s, p95 {p95:.3f} s, max {seconds[-1]:.3f} s")
    return out
