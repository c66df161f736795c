"""The critic role starts as a copy of the policy's initial weights with a fresh value head."""

import torch

from meshy.recipes.context import RoleContext
from meshy.recipes.recipe import DEFAULT_RECIPE, load_recipe
from meshy.recipes.roles.critic import CriticRole
from meshy.recipes.topology import assign
from meshy.train.parallel import ParallelConfig, build_model
from meshy.train.publish import DirectoryPublisher, hf_tensors


def test_the_critic_loads_the_policy_init_and_its_value_head_starts_at_initial_value(tmp_path):
    arch = load_recipe().model.arch()
    policy, _ = build_model(arch, ParallelConfig(), seed=7)
    init = DirectoryPublisher(tmp_path / "init", arch, dtype="float32").publish(policy, 0).location
    text = DEFAULT_RECIPE.read_text().replace('kind = "grpo"', 'kind = "ppo"')
    text = text.replace('name = "qwen3-tiny"', f'name = "qwen3-tiny"\ninit = "{init}"')
    (tmp_path / "recipe.toml").write_text(text + "\n[roles.critic]\nprocesses = 1\n")
    recipe = load_recipe(tmp_path / "recipe.toml")
    slot = next(s for s in assign(recipe, recipe.world_size).values() if s.role == "critic")
    critic = CriticRole(RoleContext(recipe, slot, tmp_path, client=None))
    model = critic.service.trainer.model
    expected = dict(hf_tensors(policy, arch, torch.float32))
    loaded = dict(hf_tensors(model.backbone, arch, torch.float32))
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], expected[name]) for name in expected), "the backbone is the policy's init"
    assert torch.all(model.value_head.weight == 0) and torch.all(
        model.value_head.bias == recipe.algorithm.initial_value
    )
