import dataclasses
import re

import pytest

from meshy.dataplane import SchemaError
from meshy.recipes.recipe import DEFAULT_RECIPE, load_recipe
from meshy.recipes.recipe.topology import assign
from meshy.train.training_config import LoraConfig

DEFAULT = DEFAULT_RECIPE.read_text()


def recipe_from(tmp_path, text: str):
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return load_recipe(path)


def moe_replay(text: str) -> str:
    """The default recipe on the tiny mixture of experts, replaying its routing."""
    return text.replace('name = "qwen3-tiny"', 'name = "qwen3-tiny-moe"').replace(
        "pacing = 1", "pacing = 1\nrouting_replay = true"
    )


def test_the_embedded_default_loads_and_resolves():
    recipe = load_recipe()
    assert recipe.world_size == 3 and recipe.algorithm.window == 1
    slots = assign(recipe, 3)
    assert [(s.role, s.index, s.device) for s in slots.values()] == [
        ("training", 0, "cpu"),
        ("inference", 0, "cpu"),
        ("rollout", 0, "cpu"),
    ]


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda t: "learning_rate = 1\n" + t, "recipe: unknown field 'learning_rate'; expected one of"),
        (
            lambda t: t.replace("[algorithm.loss]", "[algorithm.loss]\nclip_lo = 0.1"),
            "recipe.algorithm.loss: unknown field 'clip_lo'",
        ),
        (
            lambda t: t.replace("group_size = 8", 'group_size = "8"'),
            "recipe.algorithm: AlgorithmSpec.group_size: expected int, got str '8'",
        ),
        (lambda t: t.replace("pacing = 1", 'pacing = "fast"'), "pacing: expected an int >= 1 or \"none\", got 'fast'"),
        (lambda t: t.replace("pacing = 1", "pacing = 0"), "pacing: expected an int >= 1"),
        (
            lambda t: t.replace("pacing = 1", "pacing = 1\nepochs = 0"),
            "group_size, prompts_per_step, minibatches and epochs must be >= 1",
        ),
        (lambda t: t.replace('kind = "grpo"', 'kind = "ppo"'), 'algorithm.kind: "ppo" trains a learned critic'),
        (lambda t: t.replace('kind = "grpo"', 'kind = "distill"'), 'algorithm.kind: "distill" needs a [roles.teacher]'),
        (lambda t: t.replace('name = "qwen3-tiny"', 'name = "qwen4"'), "model: unknown name 'qwen4'"),
        (lambda t: t.replace("vocab_size = 17", "vocab = 17"), "overrides: unknown architecture fields ['vocab']"),
        (lambda t: 'colocate = [["training", "reward"]]\n' + t, "colocate: unknown role 'reward'"),
        (
            lambda t: 'colocate = [["training", "scorer"]]\n' + t + '\n[[roles.custom]]\nname = "scorer"\ncls = "x:Y"',
            "colocate: role 'scorer' does not take part in a GPU token ring; roles that do: "
            "['training', 'inference', 'critic', 'teacher', 'reference', 'eval']",
        ),
        (
            lambda t: (
                'colocate = [["training", "critic"]]\n'
                + t.replace('kind = "grpo"', 'kind = "ppo"').replace(
                    "[roles.training]\nprocesses = 1", "[roles.training]\nprocesses = 2"
                )
                + "\n[roles.critic]\nprocesses = 2\n"
            ),
            "colocate: ring ['training', 'critic'] holds training and critic, which each step in lock-step over "
            "their 2 processes",
        ),
        (
            lambda t: t.replace("prompts_per_step = 32", "prompts_per_step = 3").replace(
                "[roles.training]\nprocesses = 1", "[roles.training]\nprocesses = 2"
            ),
            "prompts_per_step: 3 groups do not split evenly over 2 training processes",
        ),
        (lambda t: t + '\n[[roles.custom]]\nname = "training"\ncls = "x:Y"\n', "custom role name 'training'"),
        (
            lambda t: 'publish = "collective"\ncolocate = [["training", "inference"]]\n' + t,
            'publish: "collective" needs inference running while training publishes; colocate ring '
            "['training', 'inference'] makes them take turns",
        ),
        (
            lambda t: "delta = true\n" + t,
            'delta: sending only what changed needs publish = "collective", got "disk"',
        ),
        (
            lambda t: "hf_every = -1\n" + t,
            "hf_every: expected >= 0 versions between kept HF directories, got -1",
        ),
        (
            lambda t: 'publish = "nccl"\n' + t,
            "recipe.publish: expected one of ['disk', 'shared-memory', 'collective'], got str 'nccl'",
        ),
        (
            lambda t: t.replace("[algorithm.loss]", "[algorithm.loss]\nkl_coef = 0.05"),
            "algorithm.loss.kl_coef: KL to a reference policy (0.05) needs a [roles.reference] section",
        ),
        (
            lambda t: t + "\n[roles.reference]\nprocesses = 1\n",
            "[roles.reference]: the reference role scores every response for the KL term, and "
            "algorithm.loss.kl_coef = 0 turns it off",
        ),
        (
            lambda t: with_reference(t).replace("[algorithm.loss]", "[algorithm.loss]\ntemperature = 0.7"),
            "algorithm.loss.temperature: the reference role scores at temperature 1, so KL to it "
            "(algorithm.loss.kl_coef) needs temperature = 1, got 0.7",
        ),
        (lambda t: t.replace("max_new_tokens = 3", "max_new_tokens = 0"), "max_new_tokens, max_in_flight >= 1"),
        (
            lambda t: t.replace("max_in_flight = 256", 'max_in_flight = 256\nengine = "sglang"\ncompile = true'),
            'sampling.compile: applies to the torch engine, and sampling.engine is "sglang"',
        ),
        (
            lambda t: t.replace("max_in_flight = 256", "max_in_flight = 256\ncompile = 1"),
            "SamplingSpec.compile: expected bool, got int 1",
        ),
        (
            lambda t: t.replace("pacing = 1", "pacing = 1\nrouting_replay = true"),
            "algorithm.routing_replay: model 'qwen3-tiny' is dense (num_experts = 0); routing replay needs a "
            "mixture-of-experts model",
        ),
        (
            lambda t: t.replace("pacing = 1", "pacing = 1\ntied_group_penalty = -1.0"),
            "tied_group_penalty: expected a finite value >= 0, got -1.0",
        ),
        (
            lambda t: t.replace("pacing = 1", "pacing = 1\ntied_group_penalty = 0.1\ndynamic_sampling = true"),
            'tied_group_penalty: pushes GRPO groups whose rewards are all equal; expected kind = "grpo" and '
            "dynamic_sampling = false (it drops those groups), got kind = 'grpo', dynamic_sampling = True",
        ),
        (
            lambda t: t + "\n[algorithm.parallel]\ntp = 2\n",
            "ParallelConfig.tp: expected 1, got 2: tensor parallelism is not supported",
        ),
        (
            lambda t: t + "\n[algorithm.parallel]\ncp = 4\n",
            "ParallelConfig.cp: expected 1, got 4: context parallelism is not supported",
        ),
        (
            lambda t: t.replace("pacing = 1", "pacing = 1\nrouting_replay = 1"),
            "AlgorithmSpec.routing_replay: expected bool, got int 1",
        ),
        (
            lambda t: t + "\n[roles.environment]\nprocesses = 1\n",
            "[roles.environment]: the environment role plays a multi-turn task; expected task.environment",
        ),
        (
            lambda t: t.replace("[task]", f"[task]\n{CALCULATOR}"),
            "task.environment: 'meshy.recipes.tasks.calculator:environment' makes the run multi-turn; expected a "
            "[roles.environment] section",
        ),
        (
            lambda t: multi_turn(t).replace("pacing = 1", "pacing = 1\noverlong_buffer = 2"),
            "algorithm.overlong_buffer: multi-turn runs (task.environment) train on whole trajectories with GRPO or "
            'PPO; expected algorithm.kind = "grpo" or "ppo", no routing_replay and overlong_buffer = 0',
        ),
        (lambda t: multi_turn(t) + '\n[agent]\ntemplate = "chatml"\n', "template: unknown chat template 'chatml'"),
        (lambda t: multi_turn(t) + "\n[agent]\nmax_turns = 0\n", "agent limits: expected max_turns in 1..1000"),
        (lambda t: multi_turn(t) + "\n[agent]\ntool_timeout_s = 0\n", "tool_timeout_s: expected a finite number"),
        (lambda t: multi_turn(t) + "\n[agent]\nmax_turn = 2\n", "recipe.agent: unknown field 'max_turn'"),
        (
            lambda t: multi_turn(t) + "\n[agent]\nmax_tokens = 4096\n",
            "agent.max_tokens: a trajectory's 4096 tokens after the prompt must fit sampling.context_length (512)",
        ),
        (
            lambda t: t.replace("max_in_flight = 256", "max_in_flight = 256\ncontext_length = 513"),
            "sampling.context_length: expected at most model 'qwen3-tiny''s max_position_embeddings (512)",
        ),
        (lambda t: t.replace('name = "arithmetic-tiny"', ""), "recipe: missing field 'name'"),
        (lambda t: t + '\n[[roles.custom]]\ncls = "x:Y"\n', "recipe.roles.custom[0]: missing field 'name'"),
        (lambda t: t + '\n[roles.custom]\nname = "judge"\n', "RolesSpec.custom: expected tuple[CustomRoleSpec, ...]"),
        (
            lambda t: t + '\n[[roles.custom]]\nname = "judge"\ncls = "x:Y"\ntask = "judge"\noptions = { task = "j" }\n',
            "custom role judge: options.task: set it once",
        ),
    ],
)
def test_bad_recipes_get_one_error_naming_the_field(tmp_path, edit, needle):
    with pytest.raises(SchemaError) as err:
        recipe_from(tmp_path, edit(DEFAULT))
    assert needle in str(err.value)


CALCULATOR = 'environment = "meshy.recipes.tasks.calculator:environment"'


def multi_turn(text: str) -> str:
    """The default recipe with a multi-turn task and the role that plays it."""
    return text.replace("[task]", f"[task]\n{CALCULATOR}") + "\n[roles.environment]\nprocesses = 1\n"


def test_a_multi_turn_recipe_runs_an_environment_role_and_a_turns_table(tmp_path):
    from meshy.dataplane import columns as cols
    from meshy.recipes.recipe.dataflow import recipe_tasks, tables

    recipe = recipe_from(tmp_path, multi_turn(DEFAULT))
    assert recipe.multi_turn and recipe.world_size == 4
    assert [s.role for s in assign(recipe, 4).values()] == ["training", "inference", "rollout", "environment"]
    rollout, turns = tables(recipe)
    assert {cols.POLICY_MASK, cols.PROBLEM} <= {c.name for c in rollout.columns}
    assert turns.name == "turns" and turns.retire_after == ("observe",)
    names = [t.name for t in recipe_tasks(recipe)]
    assert "agent" in names and "generate" not in names and "reward" not in names
    assert [spec.name for spec in tables(recipe_from(tmp_path, DEFAULT))] == [rollout.name]


def with_reference(text: str) -> str:
    """KL to the reference policy, and the role that scores it."""
    return text.replace("[algorithm.loss]", "[algorithm.loss]\nkl_coef = 0.05") + "\n[roles.reference]\nprocesses = 1\n"


def test_kl_to_the_reference_runs_a_reference_role_that_may_share_the_trainer_s_gpu(tmp_path):
    recipe = recipe_from(tmp_path, with_reference(DEFAULT))
    assert recipe.algorithm.loss.kl_coef == 0.05 and recipe.world_size == 4
    assert [s.role for s in assign(recipe, 4).values()] == ["training", "inference", "rollout", "reference"]
    on_gpu_0 = "processes = 1\ndevices_per_process = 1\nmemory_fraction = 0.5"
    text = with_reference(DEFAULT).replace("[roles.training]\nprocesses = 1", f"[roles.training]\n{on_gpu_0}")
    text = text.replace("[roles.reference]\nprocesses = 1", f"[roles.reference]\n{on_gpu_0}")
    shared = recipe_from(tmp_path, 'share_devices = [["training", "reference"]]\n' + text)
    devices = {s.role: s.devices for s in assign(shared, 4, gpus_per_node=1).values()}
    assert devices == {"training": (0,), "inference": (), "rollout": (), "reference": (0,)}


def test_a_routing_replay_recipe_declares_the_routed_experts_column(tmp_path):
    from meshy.dataplane import columns as cols
    from meshy.recipes.recipe.dataflow import rollout_table

    recipe = recipe_from(tmp_path, moe_replay(DEFAULT))
    assert recipe.algorithm.routing_replay
    assert rollout_table(recipe).column(cols.ROUTED_EXPERTS).shape == (None, 2, 2)  # (tokens, layers, top_k)
    dense = {c.name for c in rollout_table(recipe_from(tmp_path, DEFAULT)).columns}
    assert cols.ROUTED_EXPERTS not in dense, "a run that does not replay routing carries no such column"


def test_topology_rejects_a_world_that_does_not_fit():
    with pytest.raises(SchemaError, match="world size 4 does not match the recipe's 3 processes"):
        assign(load_recipe(), 4)


def test_colocated_roles_share_devices_and_the_rest_get_their_own(tmp_path):
    text = 'colocate = [["training", "inference"]]\n' + DEFAULT
    text = text.replace("[roles.training]\nprocesses = 1", "[roles.training]\nprocesses = 2\ndevices_per_process = 1")
    text = text.replace("[roles.inference]\nprocesses = 1", "[roles.inference]\nprocesses = 2\ndevices_per_process = 1")
    text = text.replace("[roles.rollout]\nprocesses = 1", "[roles.rollout]\nprocesses = 1\ndevices_per_process = 1")
    recipe = recipe_from(tmp_path, text)
    slots = assign(recipe, 5, gpus_per_node=8)
    by_role = {(s.role, s.index): (s.devices, s.ring) for s in slots.values()}
    assert by_role[("training", 0)] == by_role[("inference", 0)] == ((0,), "training+inference")
    assert by_role[("training", 1)] == by_role[("inference", 1)] == ((1,), "training+inference")
    assert by_role[("rollout", 0)] == ((2,), None)
    cpu = assign(recipe, 5)
    assert all(s.device == "cpu" for s in cpu.values())


def sharing(text: str, training: str = "0.5", inference: str = "0.4") -> str:
    text = text.replace(
        "[roles.training]\nprocesses = 1",
        f"[roles.training]\nprocesses = 1\ndevices_per_process = 1\nmemory_fraction = {training}",
    )
    return text.replace(
        "[roles.inference]\nprocesses = 1",
        f"[roles.inference]\nprocesses = 1\ndevices_per_process = 1\nmemory_fraction = {inference}",
    )


def test_roles_sharing_devices_at_once_get_the_same_gpus_and_no_ring(tmp_path):
    recipe = recipe_from(tmp_path, 'share_devices = [["training", "inference"]]\n' + sharing(DEFAULT))
    slots = assign(recipe, 3, gpus_per_node=1)
    assert [(s.role, s.devices, s.ring) for s in slots.values()] == [
        ("training", (0,), None),
        ("inference", (0,), None),
        ("rollout", (), None),
    ]
    assert recipe.roles.training.memory_fraction == 0.5


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            sharing(DEFAULT, inference="0.6"),
            "need memory_fraction set, adding up to at most 1; got {'training': 0.5, 'inference': 0.6}",
        ),
        (sharing(DEFAULT).replace("memory_fraction = 0.4", ""), "got {'training': 0.5, 'inference': None}"),
        (sharing(DEFAULT, training="1.5"), "memory_fraction: expected a fraction in (0, 1] of each GPU, got 1.5"),
        ('colocate = [["training", "inference"]]\n' + sharing(DEFAULT), "role 'training' already shares devices"),
        ('share_devices = [["training", "critic"]]\n' + DEFAULT, "share_devices: unknown role 'critic'"),
    ],
)
def test_a_device_sharing_group_that_cannot_work_is_refused(tmp_path, text, needle):
    if "share_devices" not in text:
        text = 'share_devices = [["training", "inference"]]\n' + text
    with pytest.raises(SchemaError) as err:
        recipe_from(tmp_path, text)
    assert needle in str(err.value)


def test_sections_reuse_the_components_configs():
    recipe = load_recipe()
    assert dataclasses.asdict(recipe.algorithm.optim)["lr"] == 3e-4
    assert recipe.algorithm.loss.tis == "none"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (b"\x80" + DEFAULT.encode(), "not valid TOML: 'utf-8' codec can't decode byte 0x80"),
        (b"steps = " + b"[" * 5000 + b"]" * 5000 + b"\n" + DEFAULT.encode(), "arrays or tables nested too deeply"),
    ],
)
def test_a_recipe_file_that_is_not_toml_is_named(tmp_path, text, needle):
    path = tmp_path / "recipe.toml"
    path.write_bytes(text)
    with pytest.raises(SchemaError, match=f"recipe {path}: {needle}"):
        load_recipe(path)


@pytest.mark.parametrize(
    ("section", "field", "value", "message"),
    [
        ("sampling", "temperature", "-1.0", "SamplingParams.temperature"),
        ("sampling", "top_p", "0.0", "SamplingParams.top_p"),
        ("algorithm", "gae_k", "2.0", "gae_k: expected 0 < gae_k <= 1, got 2.0"),
        ("algorithm", "teacher_topk", "0", "teacher_topk >= 1 and value_clip > 0, got 0"),
        ("algorithm", "value_clip", "0.0", "teacher_topk >= 1 and value_clip > 0"),
        ("algorithm", "max_staleness", "-1", "max_staleness (or none), critic_warmup_versions: expected >= 0"),
        ("algorithm", "critic_warmup_versions", "-1", "critic_warmup_versions: expected >= 0"),
        ("algorithm", "initial_value", "nan", "initial_value, overlong_factor: expected finite numbers"),
        ("algorithm", "overlong_factor", "inf", "initial_value, overlong_factor: expected finite numbers"),
    ],
)
def test_values_that_would_fail_mid_run_are_refused_at_load(tmp_path, section, field, value, message):
    text = re.sub(rf"^{field} = .*\n", "", DEFAULT_RECIPE.read_text(), flags=re.M)
    text = text.replace(f"[{section}]\n", f"[{section}]\n{field} = {value}\n", 1)
    (tmp_path / "r.toml").write_text(text)
    with pytest.raises(SchemaError, match=re.escape(message)) as e:
        load_recipe(tmp_path / "r.toml")
    assert f"recipe.{section}" in str(e.value)


def test_an_init_directory_with_a_torn_config_json_names_the_file(tmp_path):
    from meshy.recipes.recipe import ModelSpec
    from meshy.recipes.recipe.checks import check_model

    (tmp_path / "config.json").write_text('{"hidden_size": 6')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SchemaError, match=re.escape(f"model source {tmp_path / 'config.json'}: not valid JSON")):
        check_model(ModelSpec(name="qwen3-tiny", init=str(tmp_path)))


@pytest.mark.parametrize("engine", ["torch", "sglang"])
def test_collective_publishing_reaches_either_engine(tmp_path, engine):
    text = DEFAULT.replace("max_in_flight = 256", f'max_in_flight = 256\nengine = "{engine}"')
    recipe = recipe_from(tmp_path, 'publish = "collective"\n' + text)
    assert recipe.publish == "collective" and recipe.sampling.engine == engine


def test_the_sections_are_data_and_the_whole_run_is_checked_by_the_loader(tmp_path):
    """Building a Recipe checks each field; what needs the whole run (roles, layout, data flow, the weights on
    disk) is checked by recipe.checks, which load_recipe runs, naming the same paths building does."""
    from meshy.recipes.recipe import AlgorithmSpec, ModelSpec, Recipe, check_recipe

    lonely_ppo = Recipe(name="x", algorithm=AlgorithmSpec(kind="ppo"))
    with pytest.raises(SchemaError, match=re.escape('recipe: algorithm.kind: "ppo" trains a learned critic')):
        check_recipe(lonely_ppo)
    no_weights = Recipe(name="x", model=ModelSpec(init=str(tmp_path / "nowhere")))
    with pytest.raises(SchemaError, match=re.escape("recipe.model: init: expected")):
        check_recipe(no_weights)
    check_recipe(load_recipe())
    with pytest.raises(SchemaError, match=re.escape("overrides: unknown architecture fields ['x']")):
        ModelSpec(overrides={"x": 1})  # a field of its own, checked against another (name)


def test_the_sampling_section_hands_the_engines_their_settings_and_their_checks_name_a_bad_value(tmp_path):
    from meshy.infer.engine import SamplingParams
    from meshy.recipes.recipe import SamplingSpec

    spec = SamplingSpec(max_new_tokens=7, temperature=0.5, top_p=0.8, top_k=3)
    assert spec.params(seed=9) == SamplingParams(7, 0.5, 0.8, 3, seed=9)
    with pytest.raises(SchemaError, match=re.escape("recipe.sampling: SamplingParams.top_p: expected in (0, 1]")):
        recipe_from(tmp_path, DEFAULT.replace("max_in_flight = 256", "max_in_flight = 256\ntop_p = 2.0"))
    with pytest.raises(SchemaError, match=re.escape("recipe.eval: SamplingParams.max_new_tokens: expected >= 0")):
        recipe_from(tmp_path, DEFAULT + "\n[eval]\nmax_new_tokens = -1\n")


def with_lora(text: str, section: str = "") -> str:
    """The default recipe with a [model.lora] section (its fields: `section`)."""
    return text + f"\n[model.lora]\n{section}\n"


def test_model_lora_is_the_trainer_s_lora_config_and_adapts_the_policy_only(tmp_path):
    recipe = recipe_from(tmp_path, with_lora(DEFAULT, 'rank = 4\nalpha = 8.0\ntargets = ["wq", "wv", "w2"]'))
    assert recipe.model.lora == LoraConfig(rank=4, alpha=8.0, targets=("wq", "wv", "w2"))
    assert load_recipe().model.lora is None


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            lambda t: with_lora(t, 'targets = ["q_proj"]'),
            "recipe.model: lora: LoraConfig.targets: unknown projection 'q_proj' for this model; expected names among "
            "['w1', 'w2', 'w3', 'wk', 'wo', 'wq', 'wv']",
        ),
        (
            lambda t: with_lora(moe_replay(t), 'targets = ["wq", "w2"]'),
            "recipe.model: lora: LoraConfig.targets: 'w2' names a mixture-of-experts' expert weights",
        ),
        (lambda t: with_lora(t, "rank = 0"), "recipe.model.lora: LoraConfig.rank: expected >= 1, got 0"),
        (lambda t: with_lora(t, "ranks = 8"), "recipe.model.lora: unknown field 'ranks'"),
        (
            lambda t: with_lora(t.replace("[sampling]", '[sampling]\nengine = "sglang"'), "").replace(
                "seed = 0", 'seed = 0\npublish = "collective"'
            ),
            "recipe: publish: SGLang takes LoRA versions from disk or shared memory",
        ),
    ],
)
def test_a_bad_lora_section_names_the_field(tmp_path, edit, needle):
    with pytest.raises(SchemaError) as err:
        recipe_from(tmp_path, edit(DEFAULT))
    assert needle in str(err.value)


def test_a_teacher_given_as_a_peft_adapter_is_refused(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    text = DEFAULT.replace("[model]", f'[model]\nteacher = "{adapter}"')
    with pytest.raises(SchemaError) as err:
        recipe_from(tmp_path, text)
    assert f"recipe.model: teacher: {adapter} is a PEFT adapter (adapter_config.json); the teacher never takes" in str(
        err.value
    )


@pytest.mark.parametrize(
    ("top", "role", "value", "needle"),
    [
        (
            "",
            "training",
            "1",
            "roles.training.max_restarts: only ['inference', 'rollout', 'environment', 'teacher', 'reference'] "
            "restart in place so far (a training process holds the run's progress)",
        ),
        ('colocate = [["training", "inference"]]\n', "inference", "1", "a member of a colocate ring cannot restart"),
        ('publish = "collective"\n', "inference", "2", 'with publish = "collective" every engine is a member'),
        ("", "inference", "-1", "max_restarts: expected 0 to 1000 per process, got -1"),
    ],
)
def test_restarts_a_role_cannot_take_are_refused_naming_the_field(tmp_path, top, role, value, needle):
    text = top + DEFAULT_RECIPE.read_text().replace(f"[roles.{role}]\n", f"[roles.{role}]\nmax_restarts = {value}\n")
    (tmp_path / "r.toml").write_text(text)
    with pytest.raises(SchemaError, match=re.escape(needle)):
        load_recipe(tmp_path / "r.toml")
    (tmp_path / "r.toml").write_text(
        DEFAULT_RECIPE.read_text().replace("[roles.inference]\n", "[roles.inference]\nmax_restarts = 3\n")
    )
    assert load_recipe(tmp_path / "r.toml").roles.inference.max_restarts == 3


@pytest.mark.parametrize(
    ("recipe", "value", "needle"),
    [
        (DEFAULT_RECIPE, "-1", "sampling.keep_partial_every: expected tokens >= 0, got -1"),
        (
            DEFAULT_RECIPE.parent / "recipes" / "calculator-tiny-cpu.toml",
            "8",
            "sampling.keep_partial_every: a multi-turn run's turn in progress is played again",
        ),
    ],
)
def test_keeping_responses_in_progress_is_refused_where_it_cannot_work(tmp_path, recipe, value, needle):
    text = recipe.read_text().replace("[sampling]\n", f"[sampling]\nkeep_partial_every = {value}\n", 1)
    (tmp_path / "r.toml").write_text(text)
    with pytest.raises(SchemaError, match=re.escape(needle)):
        load_recipe(tmp_path / "r.toml")
