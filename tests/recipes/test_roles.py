"""What role processes build from a recipe: the critic's initial weights, the reference's weights, the engine's
devices."""

import asyncio

import pytest
import torch

from meshy.dataplane import SchemaError
from meshy.dataplane.model_source import read_model
from meshy.recipes.recipe import DEFAULT_RECIPE, load_recipe
from meshy.recipes.recipe.topology import assign
from meshy.recipes.roles.context import RoleContext
from meshy.recipes.roles.critic import CriticRole
from meshy.recipes.roles.reference_weights import publish_reference, wait_for_reference
from meshy.train.parallel import build_model
from meshy.train.publish import DirectoryPublisher, hf_tensors
from meshy.train.training_config import ParallelConfig


def test_the_critic_loads_the_policy_init_and_its_value_head_starts_at_initial_value(tmp_path):
    arch = load_recipe().model.arch()
    policy, _ = build_model(arch, ParallelConfig(), device="cpu", seed=7)
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


def test_the_reference_weights_are_version_0_kept_and_announced_again_when_a_run_resumes(client, unique, tmp_path):
    text = DEFAULT_RECIPE.read_text().replace("[algorithm.loss]", "[algorithm.loss]\nkl_coef = 0.1")
    (tmp_path / "recipe.toml").write_text(text + "\n[roles.reference]\nprocesses = 1\n")
    recipe = load_recipe(tmp_path / "recipe.toml")
    slots = assign(recipe, recipe.world_size)
    arch = recipe.model.arch()
    initial, _ = build_model(arch, ParallelConfig(), device="cpu", seed=recipe.seed)
    trained, _ = build_model(arch, ParallelConfig(), device="cpu", seed=recipe.seed + 1)
    training = RoleContext(recipe, slots[0], tmp_path / "run", client)
    reference = RoleContext(recipe, slots[3], tmp_path / "run", client)

    first, resumed = unique("reference"), unique("reference")
    publish_reference(training, initial, arch, 0, stream=first)
    publish_reference(training, trained, arch, 5, stream=resumed)  # the trained weights are not the reference
    announced = [wait_for_reference(reference, stream) for stream in (first, resumed)]
    assert announced[0] == announced[1] and announced[0].version == 0
    _, tensors = read_model(announced[0])  # verified against the announced checksum
    expected = dict(hf_tensors(initial, arch, torch.float32))
    assert tensors.keys() == expected.keys() and all(torch.equal(tensors[k], v) for k, v in expected.items())

    (tmp_path / "run" / "reference" / "published.json").unlink()
    with pytest.raises(SchemaError, match="resuming at version 5: no reference weights at"):
        publish_reference(training, trained, arch, 5, stream=unique("reference"))


def test_an_sglang_engine_is_started_on_its_role_s_own_gpus(monkeypatch, tmp_path):
    """SGLang is given the slot's first GPU and its GPU count, not the node's GPU 0 for every process."""
    import meshy.infer.sglang_engine as sglang_engine
    from meshy.recipes.recipe.topology import Slot
    from meshy.recipes.roles.engines import build_engine

    started = {}
    monkeypatch.setattr(sglang_engine, "SGLangEngine", lambda source, **kwargs: started.update(kwargs))
    text = DEFAULT_RECIPE.read_text().replace("max_in_flight = 256", 'max_in_flight = 256\nengine = "sglang"')
    (tmp_path / "recipe.toml").write_text(text)
    recipe = load_recipe(tmp_path / "recipe.toml")
    build_engine(RoleContext(recipe, Slot(5, "inference", 1, 2, (4, 5), None), tmp_path, client=None), "w")
    assert started["device"] == "cuda" and started["base_gpu_id"] == 4 and started["tp_size"] == 2
    build_engine(RoleContext(recipe, Slot(5, "inference", 1, 2, (), None), tmp_path, client=None), "w")
    assert started["device"] == "cpu"


def test_a_role_on_a_cpu_slot_builds_on_the_cpu_even_where_cuda_exists(monkeypatch, tmp_path):
    """The slot decides where a role's tensors live: the default recipe's roles have no GPUs, so on a
    GPU host they still train and generate on the CPU (and publish what the CPU computes)."""
    from meshy.recipes.roles.engines import build_engine
    from meshy.recipes.roles.training import TrainingRole

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    recipe = load_recipe()
    slots = assign(recipe, recipe.world_size, gpus_per_node=8)
    assert {slot.device for slot in slots.values()} == {"cpu"}
    training = TrainingRole(RoleContext(recipe, slots[0], tmp_path, client=None))
    assert {p.device.type for p in training.trainer.model.parameters()} == {"cpu"}
    assert training.publisher.dtype == "float32"
    engine = build_engine(RoleContext(recipe, slots[1], tmp_path, client=None), training_weights(training, tmp_path))
    try:
        assert {p.device.type for p in engine._scheduler.model.parameters()} == {"cpu"}
    finally:
        asyncio.run(engine.close())


def training_weights(training, tmp_path):
    return DirectoryPublisher(tmp_path / "weights", training.arch, dtype="float32").publish(training.trainer.model, 0)


def test_the_recipe_s_model_dtype_reaches_trainer_publisher_and_engines(monkeypatch, tmp_path):
    import meshy.infer.sglang_engine as sglang_engine
    from meshy.recipes.roles.engines import build_engine
    from meshy.recipes.roles.training import TrainingRole

    text = DEFAULT_RECIPE.read_text().replace('name = "qwen3-tiny"', 'name = "qwen3-tiny"\ndtype = "bfloat16"')
    (tmp_path / "recipe.toml").write_text(text)
    recipe = load_recipe(tmp_path / "recipe.toml")
    slots = assign(recipe, recipe.world_size)
    training = TrainingRole(RoleContext(recipe, slots[0], tmp_path, client=None))
    assert training.publisher.dtype == "bfloat16"
    tokens = torch.randint(0, 17, (2, 5), generator=torch.Generator().manual_seed(0))
    assert training.trainer.model(tokens).dtype == torch.bfloat16
    engine = build_engine(RoleContext(recipe, slots[1], tmp_path, client=None), training_weights(training, tmp_path))
    try:
        assert {p.dtype for p in engine._scheduler.model.parameters()} == {torch.bfloat16}
    finally:
        asyncio.run(engine.close())
    started = {}
    monkeypatch.setattr(sglang_engine, "SGLangEngine", lambda source, **kwargs: started.update(kwargs))
    sglang = load_recipe_text(tmp_path, text.replace("max_in_flight = 256", 'max_in_flight = 256\nengine = "sglang"'))
    build_engine(RoleContext(sglang, slots[1], tmp_path, client=None), "w")
    assert started["dtype"] == "bfloat16"


def load_recipe_text(tmp_path, text: str):
    (tmp_path / "other.toml").write_text(text)
    return load_recipe(tmp_path / "other.toml")


def _context(tmp_path) -> RoleContext:
    recipe = load_recipe()
    return RoleContext(recipe, assign(recipe, recipe.world_size)[0], tmp_path, client=None)


def test_an_async_service_stops_when_the_role_s_stop_flag_is_set_and_its_result_comes_back(tmp_path):
    ctx = _context(tmp_path)
    seen = []

    async def serve(stop: asyncio.Event) -> str:
        await stop.wait()
        seen.append("stopped")
        return "finished in flight"

    async def main() -> str:
        asyncio.get_running_loop().call_later(0.1, ctx.stop.set)  # the stop-watch thread's flag
        return await ctx.until_stopped(serve)

    assert asyncio.run(asyncio.wait_for(main(), timeout=10)) == "finished in flight" and seen == ["stopped"]


def test_an_async_service_that_ends_or_fails_on_its_own_ends_the_bridge(tmp_path):
    ctx = _context(tmp_path)

    async def done(stop: asyncio.Event) -> int:
        return 7

    async def fails(stop: asyncio.Event) -> None:
        raise RuntimeError("engine died")

    assert asyncio.run(asyncio.wait_for(ctx.until_stopped(done), timeout=10)) == 7
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(asyncio.wait_for(ctx.until_stopped(fails), timeout=10))
    assert not ctx.stop.is_set(), "the run's stop flag is the run's, not the service's"


def test_a_routing_replay_run_on_sglang_records_routing_where_it_generates(monkeypatch, tmp_path):
    """The inference role's SGLang engine reports each token's experts and holds generation in abort mode
    (meshy.infer.sglang_engine says why); engines built to score only (reference, teacher) record nothing."""
    import meshy.infer.sglang_engine as sglang_engine
    from meshy.recipes.roles.engines import build_engine
    from tests.recipes.test_recipe import moe_replay

    started = {}
    monkeypatch.setattr(sglang_engine, "SGLangEngine", lambda source, **kwargs: started.update(kwargs))
    on_sglang = DEFAULT_RECIPE.read_text().replace("max_in_flight = 256", 'max_in_flight = 256\nengine = "sglang"')
    recipe = load_recipe_text(tmp_path, moe_replay(on_sglang))
    assert recipe.algorithm.routing_replay and recipe.sampling.engine == "sglang"
    ctx = RoleContext(recipe, assign(recipe, recipe.world_size)[1], tmp_path, client=None)
    build_engine(ctx, "w", record_routing=True)
    assert started["record_routing"] is True and started["pause_mode"] == "abort"
    started.clear()
    build_engine(ctx, "w")
    assert started and "record_routing" not in started and "pause_mode" not in started
