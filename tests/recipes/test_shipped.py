"""Every shipped recipe validates, names code that imports, and resolves its topology without a GPU."""

import pytest

from meshy.recipes.recipe import load_recipe
from meshy.recipes.recipe.catalog import check_imports, gpus_needed, shipped, topology
from meshy.recipes.recipe.topology import assign

EXPECTED_GPUS = {
    "qwen3-1.7b-grpo-gsm8k-1gpu": 1,
    "qwen3-1.7b-grpo-dapo-1gpu": 1,
    "qwen3-1.7b-grpo-gsm8k-8gpu": 8,
    "qwen3-1.7b-grpo-dapo-8gpu": 8,
    "qwen3-1.7b-python-math-8gpu": 8,
    "qwen3-8b-grpo-dapo-8gpu": 8,
    "qwen3-8b-grpo-dapo-lora-1gpu": 1,
    "qwen3-30b-a3b-grpo-dapo-8gpu": 8,
    "qwen3-1.7b-grpo-dapo-2x8gpu": 8,  # GPUs per node (EXPECTED_NODES)
    "qwen3-30b-a3b-grpo-dapo-2x8gpu": 8,
    "minicpm5-1b-grpo-ultradata-8gpu": 8,
    "minicpm5-1b-grpo-ultradata-4gpu": 4,
    "minicpm5-2b-grpo-ultradata-8gpu": 8,
    "minicpm5-2b-grpo-ultradata-4gpu": 4,
    "justrl2-ppo-qwen3-1.7b-8gpu": 8,
    "distill-qwen3-8b-to-1.7b-8gpu": 8,
    "smollm2-135m-arithmetic-cpu": 0,
    "smollm2-135m-tools-cpu": 0,
    "calculator-tiny-cpu": 0,
    "default": 0,
}
EXPECTED_NODES = {"qwen3-1.7b-grpo-dapo-2x8gpu": 2, "qwen3-30b-a3b-grpo-dapo-2x8gpu": 2}  # the rest: one


def test_the_shipped_recipes_are_the_ones_documented():
    assert sorted(shipped()) == sorted(EXPECTED_GPUS)


@pytest.mark.parametrize("name", sorted(EXPECTED_GPUS))
def test_a_shipped_recipe_validates_and_its_topology_resolves(name):
    recipe = load_recipe(shipped()[name])
    assert recipe.name == name or name == "default"
    check_imports(recipe)
    gpus = gpus_needed(recipe)
    assert gpus == EXPECTED_GPUS[name]
    assert recipe.topology.nodes == EXPECTED_NODES.get(name, 1)
    slots = assign(recipe, recipe.world_size, gpus_per_node=gpus)
    assert slots[0].role == "training" and slots[0].node == 0, "rank 0 trains and hosts the data plane"
    for node in range(recipe.topology.nodes):
        used = {d for slot in slots.values() if slot.node == node for d in slot.devices}
        assert used == set(range(gpus)), f"node {node}: every GPU used"
    for ring in recipe.colocate:
        members = [s for s in slots.values() if s.role in ring]
        by_index = {}
        for slot in members:
            by_index.setdefault(slot.index, set()).add((slot.node, slot.devices))
        assert all(len(devices) == 1 for devices in by_index.values()), "ring members share their node's devices"
    nodes = recipe.topology.nodes
    assert topology(recipe).count("\n") == recipe.world_size + 1 + (nodes if nodes > 1 else 0), "a line per node too"


def test_the_justrl2_recipe_carries_the_published_hyperparameters():
    algo = load_recipe(shipped()["justrl2-ppo-qwen3-1.7b-8gpu"]).algorithm
    assert (algo.kind, algo.group_size, algo.prompts_per_step) == ("ppo", 8, 60)
    assert (algo.optim.lr, algo.optim.betas, algo.optim.weight_decay) == (1e-6, (0.9, 0.98), 0.1)
    assert (algo.loss.clip_low, algo.loss.clip_high, algo.loss.kl_coef) == (0.2, 0.28, 0.0)
    assert (algo.loss.tis, algo.loss.tis_low, algo.loss.tis_high) == ("truncate", 0.5, 5.0)
    assert (algo.critic_optim.lr, algo.value_clip, algo.initial_value) == (5e-6, 0.2, 0.52)
    assert (algo.gae_k, algo.critic_warmup_versions, algo.dynamic_sampling) == (0.5, 30, True)
