"""Slow tier: the embedded default learns its task, from chance to high reward, within minutes."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_meshy_run_default_climbs_from_chance_to_high_reward(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "run"], cwd=tmp_path, capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward_mean"] for m in metrics]
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert first < 0.15, f"starts near chance, got {first:.3f}"
    assert last >= 0.85, f"ends high, got {last:.3f}"
    assert (run_dir / "reward_curve.png").is_file() and (run_dir / "final_weights" / "config.json").is_file()
