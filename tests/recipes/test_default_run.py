"""Slow tier: the main job, `meshy run` on the embedded default, as the README promises it: it climbs from
chance to a last-20 mean reward of at least 0.9, and a second run replays it version for version (lock-step
on CPU) to the same weights. The second run stops at version REPLAYED (the recipe's pace does not depend on
its steps), which the first keeps as an HF directory to compare weights with."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from meshy.dataplane.weights import tensors_checksum
from meshy.recipes.recipe import load_recipe

pytestmark = pytest.mark.slow
REPLAYED = 200


def run_default(cwd: Path, *overrides: str) -> Path:
    cwd.mkdir()
    command = [sys.executable, "-m", "meshy.recipes.cli", "run", *(a for o in overrides for a in ("--set", o))]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    (run_dir,) = (cwd / "runs").iterdir()
    return run_dir


def per_version(run_dir: Path) -> list[tuple]:
    """What each version trained on and how: its rows, their mean reward, the step's loss and gradient norm."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(m["version"], m["row_ids"], m["reward_mean"], m["loss"], m["grad_norm"]) for m in map(json.loads, lines)]


def weights_checksum(directory: Path) -> str:
    return tensors_checksum(load_file(directory / "model.safetensors"))


def test_the_main_job_climbs_from_chance_past_0_9_and_replays_every_version(tmp_path):
    first = run_default(tmp_path / "first", f"hf_every={REPLAYED}")
    second = run_default(tmp_path / "second", f"steps={REPLAYED}")
    a, b = per_version(first), per_version(second)
    assert [v[0] for v in a] == list(range(1, load_recipe().steps + 1))
    assert [v[0] for v in b] == list(range(1, REPLAYED + 1))
    rewards = [v[2] for v in a]
    start, end = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert start < 0.15, f"starts near chance, got {start:.3f}"
    assert end >= 0.9, f"the last 20 versions' mean reward is at least 0.9, got {end:.3f}"
    diverged = next(((x, y) for x, y in zip(a[:REPLAYED], b, strict=True) if x != y), None)
    assert diverged is None, f"the runs first differ at version {diverged[0][0]}: {diverged[0]} vs {diverged[1]}"
    assert weights_checksum(first / "hf_versions" / f"v{REPLAYED:06d}") == weights_checksum(second / "final_weights")
    for run_dir in (first, second):
        assert (run_dir / "reward_curve.png").is_file() and (run_dir / "final_weights" / "config.json").is_file()
