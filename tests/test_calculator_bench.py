"""bench/calculator_curve.py: the baseline it writes is the shipped recipe without the tool and nothing
else changed, and its curve reads a run's versions and trajectories as the table says."""

import dataclasses

import pytest

from meshy.recipes.recipe import load_recipe
from meshy.recipes.recipe.catalog import shipped
from tests.benches import load_bench


def bench():
    return load_bench("calculator_curve")


def test_the_baseline_is_the_shipped_recipe_without_the_tool_and_seeds_change_only_the_seed(tmp_path):
    source = shipped()["calculator-tiny-cpu"]
    shipped_recipe = load_recipe(source)
    for tool, seed in (("true", shipped_recipe.seed), ("false", shipped_recipe.seed), ("true", 7)):
        directory = tmp_path / f"{tool}-{seed}"
        directory.mkdir()
        recipe = load_recipe(bench().recipe(directory, source, tool, seed))
        assert recipe.task.environment_options == {**shipped_recipe.task.environment_options, "tool": tool == "true"}
        assert recipe.run_dir == str(directory) and recipe.seed == seed
        same = dataclasses.replace(
            recipe, run_dir=shipped_recipe.run_dir, task=shipped_recipe.task, seed=shipped_recipe.seed
        )
        assert same == shipped_recipe, "nothing else changed"


def test_the_curve_averages_by_minute_and_reaches_the_target_over_a_window_of_versions():
    module = bench()
    versions = [(10.0 * i, 0.5) for i in range(1, 30)] + [(300.0 + i, 0.95) for i in range(1, module.WINDOW + 1)]
    trajectories = [(30.0, 1.0), (50.0, 0.2), (70.0, 1.0 - 1e-12), (80.0, 0.4)]
    curve = module.Curve(versions, trajectories)
    assert curve.reward(0, 60) == 0.5 and curve.reward(300, 360) == pytest.approx(0.95)
    assert curve.reward(400, 460) is None
    assert curve.exact(0, 60) == 0.5 and curve.exact(60, 120) == 0.5 and curve.exact(120, 180) is None
    assert curve.reached() == 318.0, "the first version whose window's mean reaches 0.9: (2 * 0.5 + 18 * 0.95) / 20"
    assert module.Curve(versions[: -module.WINDOW // 2], trajectories).reached() is None


def test_kept_runs_go_to_new_directories_and_outlive_the_bench_while_others_are_deleted(tmp_path):
    module = bench()
    kept = module.kept_directories(tmp_path / "runs", [("true", 0), ("true", 1), ("false", 0)])
    assert [p.name for p in kept] == ["tool-true-seed-0", "tool-true-seed-1", "tool-false-seed-0"]
    with module.run_directory(kept[0]) as directory:
        (directory / "metrics.jsonl").write_text("{}\n")
    assert (kept[0] / "metrics.jsonl").exists(), "a kept run stays"
    with module.run_directory(None) as directory:
        (directory / "metrics.jsonl").write_text("{}\n")
    assert not directory.exists(), "a run not kept is deleted"
    with pytest.raises(SystemExit, match="--keep: .*tool-true-seed-1 exists"):
        module.kept_directories(tmp_path / "runs", [("true", 1)])
