"""bench/gpu_check.py on the CPU: the script a GPU lease runs works before any lease is spent on it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benches import load_bench

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


def check(out: Path, *args: str, timeout: float = 900) -> tuple[int, list[dict], str]:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    summary = json.loads((out / "summary.json").read_text())
    return result.returncode, summary, (out / "summary.md").read_text()


def test_a_spent_budget_skips_the_rest_and_fails_the_check(tmp_path):
    code, summary, markdown = check(tmp_path, "--stages", "imports", "--budget", "5", timeout=60)
    assert code == 1
    assert summary == [
        {
            "name": "imports",
            "ok": False,
            "seconds": 0.0,
            "status": "skipped: the budget was spent",
            "figures": {},
            "tables": [],
        }
    ]
    assert "| imports | NO | 0 | skipped: the budget was spent |" in markdown


def test_stages_run_in_the_order_named_and_an_unknown_name_is_refused(tmp_path):
    _, summary, _ = check(tmp_path, "--stages", "weight-sync", "imports", "--budget", "5", timeout=60)
    assert [s["name"] for s in summary] == ["weight-sync", "imports"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path), "--stages", "imports", "tests"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "--stages: unknown ['tests']" in result.stderr and "'gpu-tests'" in result.stderr


@pytest.mark.slow
def test_every_stage_passes_on_the_cpu(tmp_path):
    code, summary, markdown = check(tmp_path, "--budget", "1500", timeout=1800)
    assert [(s["name"], s["status"]) for s in summary] == [
        (name, "ok")
        for name in (
            "imports",
            "gpu-tests",
            "generate",
            "async-speedup",
            "train-step",
            "generate-compiled",
            "default-colocated",
            "ring-0.6b",
            "routing-replay",
            "weight-sync",
            "ring-ppo",
            "checkpoint",
            "lora",
        )
    ], summary
    assert code == 0
    assert "| qwen3-tiny | equal |" in markdown and "| meshy training service " in markdown
    assert "torch" in (tmp_path / "stages.log").read_text()
    runs = {s["name"]: s["figures"] for s in summary}
    for name in ("default-colocated", "ring-0.6b", "ring-ppo"):
        assert runs[name]["versions_in_order"] and runs[name]["audit_clean"], runs[name]
    assert runs["ring-ppo"]["device_turns"] > 2 and runs["ring-ppo"]["device_turns_overlapping"] == 0, runs["ring-ppo"]


def test_a_ring_run_s_figures_carry_the_least_gpu_memory_each_member_found_free(tmp_path):
    """On a GPU, `meshy inspect` says how much each ring member found free as it got the token; the
    check carries it per process (on the CPU there is no such line, and no such figure)."""
    run_dir = tmp_path / "runs" / "run-1"
    (run_dir / "records").mkdir(parents=True)
    metrics = [{"version": v, "time": float(v), "reward_mean": 0.5} for v in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    inspected = "ring training+inference-0: 5 grants  turns 5, overlapping 0\n"
    gpu = inspected + "inference-0: got its GPU 3 times, finding at least 131.25 GiB free\n"
    figures = load_bench("gpu_check").run_figures(tmp_path, gpu)
    assert figures["inference-0_least_free_at_grant_GiB"] == 131.25 and figures["device_turns"] == 5
    assert not any("free" in name for name in load_bench("gpu_check").run_figures(tmp_path, inspected))
