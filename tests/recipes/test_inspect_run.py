"""`meshy inspect`'s whole report, every section of it, from a hand-written run directory."""

import json
from pathlib import Path

from meshy.recipes.observe.inspect_run import read_run, report
from meshy.recipes.roles.context import TRAFFIC_DIR, RecordKind

RING = "training+inference-0"


def write(path: Path, lines: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def trajectory(time: float, row: int, turns: int, reason: str, calls: dict, seconds: list[float]) -> dict:
    return {"kind": "trajectory", "time": time, "row": row, "turns": turns, "finish_reason": reason,
            "tool_calls": calls, "tool_errors": {}, "tool_seconds": seconds}  # fmt: skip


def a_run(root: Path) -> Path:
    """Three versions trained (v2 twice), two evaluated, a ring of training and inference on GPUs, task
    errors, an environment's trajectories and the data plane's traffic."""
    trained = [
        {"version": v, "staleness_histogram": hist, "rows_trained": 8, "dropped": dropped, "reward_mean": reward}
        for v, hist, dropped, reward in (
            (1, {"0": 30}, [], 0.25),
            (2, {"0": 20, "1": 10}, [{"row": 3, "reason": "overlong"}], 0.5),
            (2, {">=2": 10}, [], None),
        )
    ]
    evaluated = [
        {"version": v, "eval/accuracy": a, "eval/problems": 6, "eval/pass@2": p}
        for v, a, p in ((0, 0.5, 0.6), (2, 0.75, 0.8))
    ]
    write(root / "metrics.jsonl", trained + evaluated)
    records = root / "records"
    grant = {"kind": "grant", "time": 0.0, "ring": RING, "payload": None}
    turn = {"kind": "device_turn", "time": 0.0, "ring": RING}
    write(
        records / "inference-0.jsonl",
        [
            {**grant, "seq": 1, "holder": "inference", "free": 40 * 2**30},
            {**turn, "seq": 1, "start": 0.0, "end": 1.0},
            {**grant, "seq": 3, "holder": "inference", "free": 30 * 2**30},
            {"kind": "inference", "time": 9.0, "versions": [1, 2, 2, 5]},
        ],
    )
    write(
        records / "training-0.jsonl",
        [
            {**grant, "seq": 2, "holder": "training", "free": 50 * 2**30},
            {**turn, "seq": 2, "start": 0.5, "end": 2.0},
            {"kind": "released", "time": 2.0, "allocated": 0, "reserved": 12 * 2**20},
        ],
    )
    write(
        records / "rollout-0.jsonl",
        [
            {"kind": "task_errors", "time": 1.0, "rows": [4, 5], "errors": {"ZeroDivisionError: x": 2}},
            {"kind": "task_errors", "time": 2.0, "rows": [], "errors": {"KeyError: 'q'": 1}},
        ],
    )
    write(
        records / "environment-0.jsonl",
        [
            trajectory(1.0, 0, 1, "done", {"calculator": 1}, [0.5]),
            trajectory(2.0, 1, 3, "max-turns", {"calculator": 2, "": 1}, [0.25, 1.0]),
        ],
    )
    write(records / "eval-0.jsonl", [{"kind": "eval_skipped", "time": 1.0, "version": 1}])
    traffic = {"time": 0.0, "node": 0, "storage_nodes": [0, 1], "sent": [2048, 10], "received": [3 * 2**20, 0]}
    write(records / TRAFFIC_DIR / "rollout-0.jsonl", [traffic])
    return root


def test_meshy_inspect_reports_every_section_from_one_reading_of_the_run(tmp_path):
    run_dir = a_run(tmp_path / "run")
    assert report(run_dir).splitlines() == [
        f"run {run_dir}",
        "weights versions trained and published: 3 (v1..v2)  gaps []  duplicates [2]  reordered []",
        "inference-0: loaded 4 versions [1, 2, 2]...  skipped 2  duplicates [2]  reordered []",
        f"ring {RING}: 3 grants {{'inference': 2, 'training': 1}}  gaps []  duplicates []  reordered []"
        "  turns 2, overlapping 1",
        "inference-0: got its GPU 2 times, finding at least 30.00 GiB free",
        "training-0: got its GPU 1 times, finding at least 50.00 GiB free",
        "training-0: handed its GPU over 1 times, keeping at most 12 MiB reserved",
        "staleness of policy tokens as they reached training (versions behind; max_staleness masks older ones): "
        "0: 50 (71.4%), 1: 10 (14.3%), >=2: 10 (14.3%)",
        "rows trained 24, dropped 1",
        "  dropped: 1 x overlong",
        "task errors (on_task_error = drop): 2 rows dropped by rollout (training counts those it reached before"
        " the run ended), 1 problems skipped",
        "  2 x ZeroDivisionError: x",
        "  1 x KeyError: 'q'",
        "trajectories 2: turns 1: 1, 3: 1 (mean 2.00); finished done 1, max-turns 1",
        "tool calls 4, calculator 3, (malformed) 1; errors none",
        "tool latency: median 0.500 s, p95 1.000 s, max 1.000 s",
        "data-plane bytes, processes on node -> storage units on node: sent (writes), received (reads)",
        "  node 0 -> node 0: sent 2.0 KiB, received 3.0 MiB",
        "  node 0 -> node 1: sent 10 B, received 0 B",
        "mean reward: first 0.250, last 0.500, best 0.500",
        "held-out accuracy (6 problems, 2 versions evaluated, 1 overtaken): "
        "first v0 0.500, best v2 0.750, last v2 0.750",
        "held-out pass@2 (6 problems, 2 versions evaluated, 1 overtaken): first v0 0.600, best v2 0.800, last v2 0.800",
    ]


def test_the_run_s_records_are_read_into_processes_by_file_name_and_picked_by_kind_and_role(tmp_path):
    run = read_run(a_run(tmp_path / "run"))
    assert list(run.processes) == ["environment-0", "eval-0", "inference-0", "rollout-0", "training-0"]
    assert [m["version"] for m in run.metrics] == [1, 2, 2] and [m["version"] for m in run.evals] == [0, 2]
    assert [r["seq"] for r in run.of_kind(RecordKind.GRANT)] == [1, 3, 2], "file by file"
    assert [r["seq"] for r in run.of_kind(RecordKind.GRANT, role="training")] == [2]
    assert run.of_kind(RecordKind.TASK_ERRORS, role="environment") == []
    assert len(run.traffic) == 1
