"""Slow tier: the embedded default, run twice with its seed, replays version for version (lock-step on CPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from meshy.dataplane.weights import tensors_checksum

pytestmark = pytest.mark.slow
VERSIONS = 500  # the default recipe's steps


def run_default(cwd: Path) -> Path:
    cwd.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "run"], cwd=cwd, capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (run_dir,) = (cwd / "runs").iterdir()
    return run_dir


def per_version(run_dir: Path) -> list[tuple]:
    """What each version trained on and how: its rows, their mean reward, the step's loss and gradient norm."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(m["version"], m["row_ids"], m["reward_mean"], m["loss"], m["grad_norm"]) for m in map(json.loads, lines)]


def final_weights_checksum(run_dir: Path) -> str:
    return tensors_checksum(load_file(run_dir / "final_weights" / "model.safetensors"))


def test_the_default_recipe_run_twice_replays_every_version_and_ends_on_the_same_weights(tmp_path):
    first, second = run_default(tmp_path / "first"), run_default(tmp_path / "second")
    a, b = per_version(first), per_version(second)
    assert [v[0] for v in a] == [v[0] for v in b] == list(range(1, VERSIONS + 1))
    diverged = next(((x, y) for x, y in zip(a, b, strict=True) if x != y), None)
    assert diverged is None, f"the runs first differ at version {diverged[0][0]}: {diverged[0]} vs {diverged[1]}"
    assert final_weights_checksum(first) == final_weights_checksum(second)
