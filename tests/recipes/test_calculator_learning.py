"""Learning tier: the calculator recipe, from scratch, rises from chance to a 20-version mean reward of 0.6,
at least 40% of its trajectories exact answers carried from one answered calculator call; without the tool
the same run never passes 0.11 (bench/calculator_curve.py times both). One run alone on the cores:
versions, not minutes, are asserted, so a busy machine only makes it slower, and the run is stopped once
the rise is seen.

Why 0.6 and not the 0.9 most runs reach: the runs are not replayed exactly (pacing 2, four processes), and
of the ten runs of seed 0-4 so far three held below 0.9 within 1,200 versions (best 20-version means 0.68,
0.78, 0.83); every one passed 0.6. The 0.9 is the bench's figure over seeds, not
a bound a single run can be held to. Likewise the share of trajectories with one answered call in that
window: 0.947 and 0.971 in two runs of the same code (0.989 ten versions earlier in the first), so the
test asks for 0.9, far above a model that has not learned the tool (it starts near 0)."""

import re
from pathlib import Path

import pytest

from meshy.recipes.recipe.catalog import shipped
from tests.recipes.learning_run import WINDOW, first_reached, run_until_learned
from tests.recipes.test_pipeline import records, repo_env

pytestmark = pytest.mark.learning

TARGET = 0.6
TIMEOUT_S = 2700


def test_the_calculator_recipe_learns_to_call_the_tool_and_answer_exactly(tmp_path: Path):
    text = shipped()["calculator-tiny-cpu"].read_text()
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(re.sub(r"^run_dir = .*$", f'run_dir = "{tmp_path}"', text, count=1, flags=re.M))
    metrics = run_until_learned(recipe, tmp_path, TARGET, TIMEOUT_S, tmp_path / "meshy.log", env=repo_env())
    output = (tmp_path / "meshy.log").read_text()
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rewards = [m["reward_mean"] for m in metrics]
    assert len(rewards) >= WINDOW, output[-5000:]
    assert sum(rewards[:WINDOW]) / WINDOW < 0.05, "starts from chance"
    reached = first_reached(rewards, TARGET)
    means = [sum(rewards[i : i + WINDOW]) / WINDOW for i in range(len(rewards) - WINDOW + 1)]
    assert reached is not None, (
        f"a {WINDOW}-version mean reward of {TARGET} is reached in {len(rewards)} versions; the best was "
        f"{max(means):.3f}\n{output[-3000:]}"
    )
    rows = {row for m in metrics[reached : reached + WINDOW] for row in m["row_ids"]}
    played = [r for r in records(run_dir, "environment-0") if r["kind"] == "trajectory" and r["row"] in rows]
    assert len(played) == len(rows)
    exact = sum(r["reward"] > 1 - 1e-6 for r in played) / len(played)
    called = sum(r["tool_calls"].get("calculator", 0) == 1 and not r["tool_errors"] for r in played) / len(played)
    assert exact >= 0.4 and called >= 0.9, f"exact answers {exact:.2f}, one calculator call answered {called:.2f}"
