"""`meshy inspect RUN_DIR`: the control-stream audit and the staleness histogram, from a run's records;
for a multi-turn run also its trajectories (turns, finish reasons) and tool calls (by name, errors by
kind, latency); each GPU token ring's grants and its members' turns (overlapping ones counted: members
computing at once); and the bytes moved between each node's processes and each node's storage units."""

import itertools
import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from meshy.dataplane import SchemaError, SequenceAudit
from meshy.recipes.roles.context import TRAFFIC_DIR, RecordKind

TASK_ERRORS_SHOWN = 10  # the most frequent task errors `meshy inspect` lists one by one


@dataclass(frozen=True)
class RunRecords:
    """All `meshy inspect` reads of a run directory, read once."""

    metrics: list[dict]  # metrics.jsonl's line per trained version
    evals: list[dict]  # metrics.jsonl's line per evaluated version
    processes: dict[str, list[dict]]  # each process's records, by its file's name (<role>-<index>), sorted
    traffic: list[dict]  # the bytes each process's data-plane client moved (records/dataplane/)

    def of_kind(self, kind: RecordKind, role: str | None = None) -> list[dict]:
        """The records of `kind`, of every process (or of `role`'s processes), file by file."""
        return [
            r
            for name, records in self.processes.items()
            if role is None or name.startswith(f"{role}-")
            for r in records
            if r["kind"] == kind
        ]


def read_run(run_dir: Path) -> RunRecords:
    """A run directory's metrics and records (SchemaError if it has neither)."""
    lines = _lines(run_dir / "metrics.jsonl")
    records = run_dir / "records"
    if not lines and not records.is_dir():
        raise SchemaError(f"inspect: {run_dir} has no metrics.jsonl and no records/; is it a run directory?")
    return RunRecords(
        metrics=[m for m in lines if "eval/accuracy" not in m],
        evals=[m for m in lines if "eval/accuracy" in m],
        processes={path.stem: _lines(path) for path in sorted(records.glob("*.jsonl"))},
        traffic=[line for path in sorted((records / TRAFFIC_DIR).glob("*.jsonl")) for line in _lines(path)],
    )


def report(run_dir: str | Path) -> str:
    """What `meshy inspect RUN_DIR` prints: a section per function below, in order, each from the run's
    records as read once."""
    run_dir = Path(run_dir)
    run = read_run(run_dir)
    sections = (
        _versions_trained,
        _versions_loaded,
        _restarts,
        _kept_rows,
        _rings,
        _gpu_handovers,
        _staleness,
        _rows,
        _task_errors,
        _trajectories,
        _traffic,
        _rewards,
        _evaluations,
    )
    return "\n".join([f"run {run_dir}", *(line for section in sections for line in section(run))])


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _audit(sequence: list[int]) -> SequenceAudit:
    audit = SequenceAudit()
    for value in sequence:
        audit.observe(value)
    return audit


def _versions_trained(run: RunRecords) -> list[str]:
    versions = [m["version"] for m in run.metrics]
    audit = _audit(versions)
    return [
        f"weights versions trained and published: {len(versions)}"
        + (f" (v{versions[0]}..v{versions[-1]})" if versions else "")
        + f"  gaps {audit.gaps}  duplicates {audit.duplicates}  reordered {audit.reordered}"
    ]


def _versions_loaded(run: RunRecords) -> list[str]:
    """The versions each inference process loaded, and those it skipped (newer ones came first)."""
    out = []
    for name, records in run.processes.items():
        loads = [r for r in records if r["kind"] == RecordKind.INFERENCE]
        if loads:
            loaded = [v for r in loads for v in r["versions"]]
            audit = _audit(loaded)
            out.append(
                f"{name}: loaded {len(loaded)} versions {loaded[:3]}{'...' if len(loaded) > 3 else ''}"
                f"  skipped {sum(b - a + 1 for a, b in audit.gaps)}  duplicates {audit.duplicates}"
                f"  reordered {audit.reordered}"
            )
    return out


def _restarts(run: RunRecords) -> list[str]:
    """Each process started again in place (max_restarts): how often, killed by what, rows given back."""
    out = []
    for name, records in run.processes.items():
        restarts = [r for r in records if r["kind"] == RecordKind.RESTART]
        if restarts:
            signals = Counter(r["signal"] for r in restarts)
            out.append(
                f"{name}: restarted {len(restarts)} of {restarts[-1]['max_restarts']} times in place ("
                + ", ".join(f"{n} x {signal}" for signal, n in signals.most_common())
                + f"), {sum(r['released'] for r in restarts)} leased rows given back to the pool"
            )
    return out


def _kept_rows(run: RunRecords) -> list[str]:
    """Each resume's rows read back from the data plane's logs: kept, waiting for generation, dropped (why),
    with their response lengths, so a bias towards long or short rollouts shows."""
    out = []
    for kept in run.of_kind(RecordKind.KEPT_ROWS):
        out.append(f"resumed at v{kept['version']} with rows kept on disk:")
        shares = [("kept, generated", kept["kept"])]
        if kept.get("retrained", {}).get("rows"):  # (older records have no such figure)
            shares += [("of them trained again: a version after the checkpoint had trained them", kept["retrained"])]
        shares += [("kept, waiting for generation", kept["waiting"])]
        shares += [("kept, responses in progress to continue", kept["partial"])] if kept["partial"]["rows"] else []
        shares += [(f"dropped: {reason}", f) for reason, f in kept["dropped"].items()]
        for what, f in shares:
            out.append(
                f"  {f['rows']} rows, {f['tokens']} tokens (length p50 {f['length_p50']}, p90 {f['length_p90']}, "
                f"max {f['length_max']}): {what}"
            )
        if kept.get("torn_bytes"):
            out.append(f"  a torn record of {kept['torn_bytes']} bytes was cut from the logs")
    return out


def _rings(run: RunRecords) -> list[str]:
    """Each GPU token ring's grants, audited, and its members' turns (overlapping ones: members computing
    at once)."""
    grants = sorted((r["seq"], r["ring"], r["holder"]) for r in run.of_kind(RecordKind.GRANT))
    turns = [(r["ring"], r["start"], r["end"]) for r in run.of_kind(RecordKind.DEVICE_TURN)]
    out = []
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
    return out


def _gpu_handovers(run: RunRecords) -> list[str]:
    """Each colocated process's GPU memory: the least it found free as it got the token, the most it kept
    reserved after handing it on."""
    out = []
    for name, records in run.processes.items():
        free = [r["free"] for r in records if r["kind"] == RecordKind.GRANT and r.get("free") is not None]
        if free:
            out.append(f"{name}: got its GPU {len(free)} times, finding at least {min(free) / 2**30:.2f} GiB free")
        released = [r for r in records if r["kind"] == RecordKind.RELEASED]
        if released:
            most = max(r["reserved"] for r in released) / 2**20
            out.append(f"{name}: handed its GPU over {len(released)} times, keeping at most {most:.0f} MiB reserved")
    return out


def _staleness(run: RunRecords) -> list[str]:
    histogram: Counter = Counter()
    for m in run.metrics:
        histogram.update(m.get("staleness_histogram", {}))
    total = sum(histogram.values())
    return [
        "staleness of policy tokens as they reached training (versions behind; max_staleness masks older ones): "
        + (
            ", ".join(
                f"{k}: {v} ({v / total:.1%})"
                for k, v in sorted(histogram.items(), key=lambda kv: int(kv[0].lstrip(">=")))
            )
            if total
            else "no policy tokens reached training"
        )
    ]


def _rows(run: RunRecords) -> list[str]:
    reasons = Counter(d["reason"] for m in run.metrics for d in m.get("dropped", []))
    trained = sum(m.get("rows_trained", 0) for m in run.metrics)
    return [
        f"rows trained {trained}, dropped {sum(reasons.values())}"
        + "".join(f"\n  dropped: {n} x {reason}" for reason, n in reasons.most_common())
    ]


def _task_errors(run: RunRecords) -> list[str]:
    """What the task's code failed on in a run that drops such rows (on_task_error = "drop"): rows dropped,
    problems skipped, by error."""
    records = run.of_kind(RecordKind.TASK_ERRORS, role="rollout")
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


def _trajectories(run: RunRecords) -> list[str]:
    """The environment role's trajectories: one per rollout row, the last played (a resumed run plays
    again the rows its checkpoint had not trained)."""
    records = run.of_kind(RecordKind.TRAJECTORY, role="environment")
    played = {r["row"]: r for r in sorted(records, key=lambda r: r["time"])}
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


def _traffic(run: RunRecords) -> list[str]:
    """The bytes the processes' data-plane clients moved, by the client's node and the storage unit's
    (every run of a resumed run counted)."""
    moved: Counter = Counter()
    for line in run.traffic:
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


def _rewards(run: RunRecords) -> list[str]:
    rewards = [m["reward_mean"] for m in run.metrics if m.get("reward_mean") is not None]
    if not rewards:
        return []
    return [f"mean reward: first {rewards[0]:.3f}, last {rewards[-1]:.3f}, best {max(rewards):.3f}"]


def _evaluations(run: RunRecords) -> list[str]:
    """The held-out accuracy's curve: its first, best and last evaluated versions (and pass@k's)."""
    evals = run.evals
    if not evals:
        return []
    skipped = len(run.of_kind(RecordKind.EVAL_SKIPPED, role="eval"))
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
