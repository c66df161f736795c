"""bench/async_speedup.py's recipes load as they are written, including the one for a GPU (which no CI
machine can run): a recipe the bench would fail to load costs a GPU lease."""

import argparse

import pytest

from meshy.recipes.recipe import load_recipe
from meshy.recipes.recipe.topology import assign
from tests.benches import load_bench


def bench():
    return load_bench("async_speedup")


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("pacing", ["1", '"none"'])
def test_the_bench_writes_recipes_that_load(tmp_path, gpu, pacing):
    args = argparse.Namespace(
        steps=6, max_new_tokens=256, prompts_per_step=32, gpu=gpu, model="qwen3-0.6b", training_fraction=0.45,
        minibatches=8,
    )  # fmt: skip
    recipe = load_recipe(bench().recipe(tmp_path, pacing, args))
    assert recipe.steps == 6 and recipe.sampling.max_new_tokens == 256
    assert recipe.algorithm.window == (None if pacing == '"none"' else 1)
    if gpu:
        assert recipe.model.name == "qwen3-0.6b" and recipe.model.dtype == "bfloat16"
        assert recipe.algorithm.minibatches == 8 and recipe.publish == "shared-memory"
        slots = assign(recipe, recipe.world_size, gpus_per_node=1)
        assert [(s.role, s.devices, s.ring) for s in slots.values()][:2] == [
            ("training", (0,), None),
            ("inference", (0,), None),
        ]
