"""A run with held-out evaluation ([eval]), end to end on CPU: the eval role evaluates version 0, every
`every`-th and the last while training goes on, and its figures land in metrics.jsonl, TensorBoard's
scalars, the curve and `meshy inspect`."""

import json
import subprocess
import sys

from tests.recipes.test_pipeline import records, run, small_recipe

EVAL = "\n[eval]\nevery = 2\ncount = 6\n"


def test_the_eval_role_evaluates_versions_0_every_second_and_the_last_on_held_out_problems(tmp_path):
    run_dir = run(small_recipe(tmp_path, "1", tail=EVAL, steps=5))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m["version"] for m in lines if "eval/accuracy" not in m]
    evals = [m for m in lines if "eval/accuracy" in m]
    assert trained == [1, 2, 3, 4, 5]
    assert [m["version"] for m in evals] == [0, 2, 4, 5]
    for m in evals:
        assert 0 <= m["eval/accuracy"] <= 1 and m["eval/problems"] == 6, m
    evaluated = [r for r in records(run_dir, "eval-0") if r["kind"] == "eval"]
    assert [r["version"] for r in evaluated] == [0, 2, 4, 5]
    assert all(len(r["examples"]) == 3 and r["examples"][0]["prompt"].endswith("=") for r in evaluated)
    assert not list((run_dir / "eval").iterdir()), "the eval role deletes each version it evaluated"
    batches = [r for r in records(run_dir, "rollout-0") if r["kind"] == "batch"]
    assert batches[-1]["held_out_skipped"] > 0, "rollout skipped held-out problems"
    start = next(r for r in records(run_dir, "training-0") if r["kind"] == "start")
    assert start["threads"] >= 1
    report = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "inspect", str(run_dir)], capture_output=True, text=True, check=True
    ).stdout
    assert "held-out accuracy (6 problems, 4 versions evaluated): first v0" in report
    assert "weights versions trained and published: 5 (v1..v5)" in report
