"""A recipe checked as a whole, once its sections are built: what no section can check by itself (the roles an
algorithm needs, the rings and groups that share devices, the layout over nodes, the data flow between the
roles, the weights the model starts from). The sections check their own fields (meshy.recipes.recipe.spec);
load_recipe runs these checks after them, and so must code that builds a Recipe itself."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from meshy.dataplane import DataPlaneConfig, SchemaError
from meshy.dataplane.hf_directory import ADAPTER_CONFIG
from meshy.dataplane.weights import Transport
from meshy.recipes.recipe.dataflow import check_dataflow
from meshy.recipes.recipe.spec import RESTARTABLE_ROLES, RING_ROLES, ModelSpec, Recipe
from meshy.recipes.recipe.topology import layout
from meshy.recipes.weights.pretrained import check_init


def check_recipe(recipe: Recipe) -> None:
    """Every whole-run check, the model's weights first; an error names the field's full path under `recipe`."""
    with _under("recipe.model"):
        check_model(recipe.model)
    with _under("recipe"):
        check_run(recipe)


def check_model(model: ModelSpec) -> None:
    """The weights model.init names can be read (an HF directory is opened) and have the model's shape; the
    teacher is a whole model; model.lora adapts projections the model has."""
    check_init(model.init, model.arch())
    if model.teacher is not None and (Path(model.teacher) / ADAPTER_CONFIG).is_file():
        raise SchemaError(
            f"teacher: {model.teacher} is a PEFT adapter ({ADAPTER_CONFIG}); the teacher never takes adapters: "
            "expected a whole model (peft's merge_and_unload(), then save_pretrained)"
        )
    if model.lora is not None:
        _check_lora_targets(model)


def _check_lora_targets(model: ModelSpec) -> None:
    """model.lora's targets are projections the model has (the model built on the meta device: its modules, no
    memory). torchtitan is imported here only: validating a recipe without LoRA, or a role that never trains,
    does not pay for it."""
    import torch

    from meshy.train.lora import apply_lora
    from meshy.train.titan_models import titan_config

    with torch.device("meta"):
        shape = titan_config(model.arch()).build()
    with _under("lora"):
        apply_lora(shape, model.lora)


def check_run(recipe: Recipe) -> None:
    """The sections together: the roles the algorithm, the task and the publishing need, the data flow, the
    colocation rings and share_devices groups, and the layout over the nodes."""
    roles = dict(recipe.roles.items())
    kind = recipe.algorithm.kind
    if kind == "ppo" and "critic" not in roles:
        raise SchemaError('algorithm.kind: "ppo" trains a learned critic; add a [roles.critic] section')
    if kind == "distill" and ("teacher" not in roles or recipe.model.teacher is None):
        raise SchemaError('algorithm.kind: "distill" needs a [roles.teacher] section and model.teacher')
    _check_reference(recipe, roles)
    if recipe.multi_turn or "environment" in roles:
        _check_multi_turn(recipe, roles)
    if recipe.publish is Transport.COLLECTIVE:
        _check_collective(recipe)
    elif recipe.delta:
        raise SchemaError(f'delta: sending only what changed needs publish = "collective", got "{recipe.publish}"')
    if recipe.algorithm.routing_replay:
        _check_routing_replay(recipe)
    if recipe.model.lora is not None and recipe.sampling.engine == "sglang" and recipe.publish is Transport.COLLECTIVE:
        raise SchemaError(
            "publish: SGLang takes LoRA versions from disk or shared memory (its weight-sync receive loads whole "
            'models only); expected "disk" or "shared-memory" with model.lora and sampling.engine = "sglang"'
        )
    _check_context_length(recipe)
    _check_eval(recipe)
    check_dataflow(recipe)
    if recipe.algorithm.overlong_buffer > recipe.sampling.max_new_tokens:
        raise SchemaError(
            f"algorithm.overlong_buffer: expected <= sampling.max_new_tokens ({recipe.sampling.max_new_tokens}), "
            f"got {recipe.algorithm.overlong_buffer}"
        )
    if recipe.algorithm.prompts_per_step % recipe.roles.training.processes:
        raise SchemaError(
            f"algorithm.prompts_per_step: {recipe.algorithm.prompts_per_step} groups do not split evenly "
            f"over {recipe.roles.training.processes} training processes"
        )
    seen = set()
    for ring in recipe.colocate:
        for role in ring:
            if role not in roles:
                raise SchemaError(f"colocate: unknown role {role!r}; roles are {list(roles)}")
            if role not in RING_ROLES:
                raise SchemaError(
                    f"colocate: role {role!r} does not take part in a GPU token ring; roles that do: {list(RING_ROLES)}"
                )
            if role in seen:
                raise SchemaError(f"colocate: role {role!r} is in more than one ring")
            seen.add(role)
        sizes = {roles[r].processes for r in ring}
        if len(ring) < 2 or len(sizes) != 1:
            raise SchemaError(f"colocate: ring {list(ring)} needs >= 2 roles with equal process counts")
        if {"training", "critic"} <= set(ring) and sizes != {1}:
            raise SchemaError(
                f"colocate: ring {list(ring)} holds training and critic, which each step in lock-step over "
                f"their {sizes.pop()} processes: one could hold ring i's token waiting for a peer that waits "
                "for ring j's, held by the other (a deadlock); colocate them with processes = 1, or put the "
                "critic in share_devices"
            )
    for group in recipe.share_devices:
        for role in group:
            if role not in roles:
                raise SchemaError(f"share_devices: unknown role {role!r}; roles are {list(roles)}")
            if role in seen:
                raise SchemaError(f"share_devices: role {role!r} already shares devices (colocate or another group)")
            seen.add(role)
        specs = [roles[r] for r in group]
        if len(group) < 2 or len({(s.processes, s.devices_per_process) for s in specs}) != 1:
            raise SchemaError(
                f"share_devices: group {list(group)} needs >= 2 roles with equal processes and devices_per_process"
            )
        fractions = [s.memory_fraction for s in specs]
        if None in fractions or sum(fractions) > 1:
            raise SchemaError(
                f"share_devices: roles {list(group)} need memory_fraction set, adding up to at most 1; got "
                f"{dict(zip(group, fractions, strict=True))}"
            )
    _check_restarts(recipe, roles)
    _check_topology(recipe)


def _check_restarts(recipe: Recipe, roles: dict) -> None:
    """A process started again in place joins no process group and no token ring, and takes up the run where
    it is: only roles that hold nothing of the run's progress, reached by no fixed group."""
    ringed = {role for ring in recipe.colocate for role in ring}
    for role, spec in roles.items():
        if not getattr(spec, "max_restarts", 0):
            continue
        if role not in RESTARTABLE_ROLES:
            raise SchemaError(
                f"roles.{role}.max_restarts: only {list(RESTARTABLE_ROLES)} restart in place so far (a {role} "
                "process holds the run's progress); set 0: a death stops the run, and meshy run --resume "
                "carries it on"
            )
        if role in ringed:
            raise SchemaError(
                f"roles.{role}.max_restarts: a member of a colocate ring cannot restart in place (the ring's "
                "token may die with it); set 0, or share the devices with share_devices instead"
            )
        if role == "inference" and recipe.publish is Transport.COLLECTIVE:
            raise SchemaError(
                f'roles.{role}.max_restarts: with publish = "collective" every engine is a member of a fixed '
                'process group, which a restarted one cannot rejoin; use publish = "disk" or "shared-memory", '
                "or set 0"
            )


def _check_topology(recipe: Recipe) -> None:
    """The layout over nodes is checked here, whole, before any node starts; a single node's GPUs are
    counted when it starts, unless the recipe names them (topology.gpus_per_node)."""
    topology = recipe.topology
    gpu_roles = any(spec.devices_per_process for _, spec in recipe.roles.items())
    if topology.nodes > 1 and topology.gpus_per_node is None and gpu_roles:
        raise SchemaError(
            f"topology.gpus_per_node: a recipe for {topology.nodes} nodes with GPU roles names the GPUs of "
            "each node, so that every node computes the same layout"
        )
    if recipe.roles.training.node:
        raise SchemaError(
            "roles.training.node: training process 0 runs on node 0 (it hosts the data plane's controller), "
            f"got {recipe.roles.training.node}"
        )
    if topology.nodes > 1 and recipe.dataplane.host != DataPlaneConfig.host:
        raise SchemaError(
            f"dataplane.host: a multi-node run binds each node's own address ({recipe.dataplane.host!r} cannot "
            "be every node's); name them in topology.addresses, or leave both out"
        )
    slots = layout(recipe, topology.gpus_per_node or 0)
    publisher = next(s.node for s in slots if s.role == "training")
    remote = sorted({s.node for s in slots if s.role == "inference"} - {publisher})
    if recipe.publish is Transport.SHARED_MEMORY and remote:
        raise SchemaError(
            'publish: "shared-memory" reaches engines on the node of training process 0 only, and inference '
            f'runs on node {remote[0]} too; use publish = "collective" (or "disk" on a filesystem every '
            "node mounts)"
        )


def _check_collective(recipe: Recipe) -> None:
    """The broadcast needs every engine running and joining each version as it is announced: engines
    that hand their devices to the trainer in turn cannot."""
    for ring in recipe.colocate:
        if "training" in ring and "inference" in ring:
            raise SchemaError(
                f'publish: "collective" needs inference running while training publishes; colocate ring '
                f'{list(ring)} makes them take turns: use publish = "disk" or "shared-memory"'
            )


def _check_reference(recipe: Recipe, roles: dict) -> None:
    """KL to the reference policy and the role that writes its ref_logprobs come together: a KL term
    without the role would wait for the column forever, the role without the term would score for
    nothing."""
    loss = recipe.algorithm.loss
    if loss.kl_coef and "reference" not in roles:
        raise SchemaError(
            f"algorithm.loss.kl_coef: KL to a reference policy ({loss.kl_coef}) needs a [roles.reference] "
            "section, the role that writes ref_logprobs; add one or set kl_coef = 0"
        )
    if "reference" in roles and not loss.kl_coef:
        raise SchemaError(
            "[roles.reference]: the reference role scores every response for the KL term, and "
            "algorithm.loss.kl_coef = 0 turns it off; set kl_coef > 0 or remove the section"
        )
    if loss.kl_coef and loss.temperature != 1:
        raise SchemaError(
            f"algorithm.loss.temperature: the reference role scores at temperature 1, so KL to it "
            f"(algorithm.loss.kl_coef) needs temperature = 1, got {loss.temperature}"
        )


def _check_multi_turn(recipe: Recipe, roles: dict) -> None:
    if not recipe.multi_turn:
        raise SchemaError(
            "[roles.environment]: the environment role plays a multi-turn task; expected task.environment "
            "(its environment factory), or no [roles.environment] section"
        )
    if "environment" not in roles:
        raise SchemaError(
            f"task.environment: {recipe.task.environment!r} makes the run multi-turn; expected a "
            "[roles.environment] section, the role that plays its trajectories"
        )
    if recipe.agent.max_tokens >= recipe.sampling.context_length:
        raise SchemaError(
            f"agent.max_tokens: a trajectory's {recipe.agent.max_tokens} tokens after the prompt must fit "
            f"sampling.context_length ({recipe.sampling.context_length}) with the prompt; expected fewer"
        )
    for name, unsupported in (
        ("algorithm.kind", recipe.algorithm.kind == "distill"),
        ("algorithm.routing_replay", recipe.algorithm.routing_replay),
        ("algorithm.overlong_buffer", recipe.algorithm.overlong_buffer > 0),
    ):
        if unsupported:
            raise SchemaError(
                f"{name}: multi-turn runs (task.environment) train on whole trajectories with GRPO or PPO; "
                'expected algorithm.kind = "grpo" or "ppo", no routing_replay and overlong_buffer = 0'
            )
    if recipe.sampling.keep_partial_every:
        raise SchemaError(
            "sampling.keep_partial_every: a multi-turn run's turn in progress is played again after a resume (its "
            "environment's state is not kept); expected 0"
        )


def _check_context_length(recipe: Recipe) -> None:
    positions = recipe.model.arch().max_position_embeddings
    if recipe.sampling.context_length > positions:
        raise SchemaError(
            f"sampling.context_length: expected at most model {recipe.model.name!r}'s max_position_embeddings "
            f"({positions}), the positions a prompt and its response share, got {recipe.sampling.context_length} "
            "(model.overrides can raise max_position_embeddings)"
        )


def _check_eval(recipe: Recipe) -> None:
    if recipe.roles.eval is not None and recipe.eval is None:
        raise SchemaError(
            "[roles.eval]: the eval role evaluates what an [eval] section describes; add one, or remove the role"
        )
    if recipe.eval is None:
        return
    if recipe.multi_turn:
        raise SchemaError(
            "eval: held-out evaluation plays single-turn problems; a multi-turn task (task.environment) is not "
            "evaluated by the eval role yet"
        )
    if recipe.eval_max_new_tokens >= recipe.sampling.context_length:
        raise SchemaError(
            f"eval.max_new_tokens: {recipe.eval_max_new_tokens} tokens leave no room for a prompt in "
            f"sampling.context_length ({recipe.sampling.context_length}); expected fewer"
        )


def _check_routing_replay(recipe: Recipe) -> None:
    arch = recipe.model.arch()
    if not arch.moe:
        raise SchemaError(
            f"algorithm.routing_replay: model {recipe.model.name!r} is dense (num_experts = 0); routing replay "
            "needs a mixture-of-experts model"
        )


@contextmanager
def _under(path: str) -> Iterator[None]:
    """Name the path of the section being checked before its error, as building the section does."""
    try:
        yield
    except SchemaError as e:
        raise SchemaError(f"{path}: {e}") from None
