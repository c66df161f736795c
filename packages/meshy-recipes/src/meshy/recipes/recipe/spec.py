"""Recipes: one TOML file declares a whole run. Typed, and validated before any process starts.

Every section is a frozen dataclass that checks its own fields; `build` makes them from a TOML file's data,
failing with one error naming the field's full path (`recipe.algorithm.loss.clip_low: ...`) for an unknown
field or a wrong type. What only the whole run can check (an impossible topology, a column nobody writes, the
weights the model starts from) is checked by meshy.recipes.recipe.checks, after the sections are built:
load_recipe (meshy.recipes.recipe.load) runs both.
Sections reuse the components' own configs (LoraConfig, LossConfig, OptimConfig, ParallelConfig, DataPlaneConfig).
"""

import dataclasses
import enum
import importlib.util
import ipaddress
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from meshy.dataplane import Column, DataPlaneConfig, SchemaError
from meshy.dataplane.fields import check_fields
from meshy.dataplane.weights import Transport
from meshy.infer.engine import SamplingParams
from meshy.recipes.agents.trajectory import AgentLimits
from meshy.recipes.prompts.chat_templates import TEMPLATES
from meshy.train.models import get_model
from meshy.train.training_config import LoraConfig, LossConfig, OptimConfig, ParallelConfig

BUILTIN_ROLES = ("training", "inference", "rollout", "environment", "critic", "teacher", "reference", "eval")
# the roles that hand devices over through a GPU token ring (meshy.recipes.roles.colocation)
RING_ROLES = ("training", "inference", "critic", "teacher", "reference", "eval")
EVAL_SEED = 999_983  # the held-out set's default seed: the same set whatever the run's seed
DEFAULT_RECIPE = Path(__file__).parents[1] / "default.toml"
# Bounds on a topology, far beyond any cluster, so that a mistyped count is refused instead of laid out
MAX_NODES = 1 << 14
MAX_PROCESSES = 1 << 16  # per role
MAX_RESTARTS = 1000  # per process: a role that dies more often than this is broken, not unlucky
# roles that hold no state a restart would lose (rollout reads what its predecessor wrote from the data plane)
RESTARTABLE_ROLES = ("inference", "rollout", "environment", "teacher", "reference")


def _check_placement(spec: "RoleSpec | CustomRoleSpec") -> None:
    if not 1 <= spec.processes <= MAX_PROCESSES or not 0 <= spec.devices_per_process <= MAX_PROCESSES:
        raise SchemaError(
            f"processes: expected 1 to {MAX_PROCESSES}, devices_per_process 0 to {MAX_PROCESSES}, got {spec}"
        )
    if spec.node is not None and not 0 <= spec.node < MAX_NODES:
        raise SchemaError(f"node: expected a node index from 0 to {MAX_NODES - 1}, got {spec.node}")
    if spec.memory_fraction is not None and not 0 < spec.memory_fraction <= 1:
        raise SchemaError(f"memory_fraction: expected a fraction in (0, 1] of each GPU, got {spec.memory_fraction}")
    if spec.threads < 0:
        raise SchemaError(f"threads: expected >= 0 CPU threads per process (0: the default), got {spec.threads}")


@dataclass(frozen=True)
class RoleSpec:
    """Where a built-in role runs ([roles.<name>]): how many processes, on which devices and node."""

    processes: int = 1
    """How many ranks (processes) run the role."""
    devices_per_process: int = 0
    """GPUs each process uses (0: the CPU)."""
    memory_fraction: float | None = None
    """The share, in (0, 1], of each of its GPUs the role may allocate (None: all of it); needed when roles share
    GPUs at the same time (share_devices)."""
    node: int | None = None
    """The node its first process runs on (None: where the role before it ended; meshy.recipes.recipe.topology)."""
    threads: int = 0
    """CPU threads of each process's tensor ops (0: every core of the host for a role on the CPU, one for a role on
    GPUs)."""
    max_restarts: int = 0
    """Times a process of the role killed by a signal (SIGKILL, the OOM killer) is started again in place while the
    run goes on; past them, or with 0, the run stops as any process's death stops it (meshy run --resume). Inference,
    rollout, environment, teacher and reference only (they hold nothing of the run's progress), not in a colocate
    ring, nor inference with publish = "collective"; each process then runs the role in a child of its own
    (meshy.recipes.launch.restarts)."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check_placement(self)
        if not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise SchemaError(f"max_restarts: expected 0 to {MAX_RESTARTS} per process, got {self.max_restarts}")


@dataclass(frozen=True)
class CustomRoleSpec:
    """A role the framework does not know ([[roles.custom]]), built as `cls(ctx, **options)`. The placement
    fields (processes, devices_per_process, memory_fraction, node, threads) are RoleSpec's."""

    name: str
    """The role's name: an identifier other than a built-in role's."""
    cls: str
    """The role's class, as an import path "package.module:Class"."""
    processes: int = 1
    """How many ranks (processes) run the role."""
    devices_per_process: int = 0
    """GPUs each process uses (0: the CPU)."""
    memory_fraction: float | None = None
    """The share, in (0, 1], of each of its GPUs the role may allocate (None: all of it); needed when roles share
    GPUs at the same time (share_devices)."""
    node: int | None = None
    """The node its first process runs on (None: where the role before it ended; meshy.recipes.recipe.topology)."""
    threads: int = 0
    """CPU threads of each process's tensor ops (0: every core of the host for a role on the CPU, one for a role on
    GPUs)."""
    options: dict = field(default_factory=dict)
    """Keyword arguments the class is built with, after ctx."""
    task: str = ""
    """The data-plane task under which the role leases and acks rows, if it consumes them; the table then keeps
    every row until that task has acked it too, and the class also gets `task=...` (set it here, not in options).
    Without it, rows are freed once training is done with them, scored or not."""
    reads: tuple[str, ...] = ()
    """The columns the task leases rows by, so the recipe is refused if a column it reads has no writer
    (meshy.recipes.recipe.dataflow); needs task."""
    writes: tuple[str, ...] = ()
    """The [[extra_columns]] the role adds (it writes only those); needs task."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check_placement(self)
        if self.name in BUILTIN_ROLES or not self.name.isidentifier():
            raise SchemaError(f"custom role name {self.name!r}: expected an identifier other than {BUILTIN_ROLES}")
        if ":" not in self.cls:
            raise SchemaError(f"custom role {self.name}: cls {self.cls!r} is not 'package.module:Class'")
        if self.task and "task" in self.options:
            raise SchemaError(f"custom role {self.name}: options.task: set it once, as task, not in options")
        if (self.reads or self.writes) and not self.task:
            raise SchemaError(
                f"custom role {self.name}: reads, writes: columns are read and written under a task; expected "
                "task = the name under which the role leases rows"
            )

    def arguments(self) -> dict:
        """The keyword arguments the role class is built with (after ctx)."""
        return {**self.options, "task": self.task} if self.task else dict(self.options)


@dataclass(frozen=True)
class RolesSpec:
    """The run's roles ([roles.<name>] sections, each a RoleSpec). The optional ones run only when their section
    is there."""

    training: RoleSpec = field(default_factory=RoleSpec)
    """The policy trainer; its rank 0 hosts the data plane (and runs on node 0)."""
    inference: RoleSpec = field(default_factory=RoleSpec)
    """The engines (sampling.engine) that generate responses."""
    rollout: RoleSpec = field(default_factory=RoleSpec)
    """Writes prompts (task.problems), paced by weights versions; scores responses (task.reward; a multi-turn
    task's environment role scores them instead) and computes advantages."""
    environment: RoleSpec | None = None
    """Plays multi-turn trajectories (task.environment); a multi-turn task needs it, and only such a task may
    have it."""
    critic: RoleSpec | None = None
    """PPO's learned values; algorithm.kind = "ppo" needs it."""
    teacher: RoleSpec | None = None
    """Online policy distillation's top-k (algorithm.teacher_topk); algorithm.kind = "distill" needs it."""
    reference: RoleSpec | None = None
    """The frozen initial policy, scoring every response for KL to it; present exactly when algorithm.loss.kl_coef
    > 0."""
    eval: RoleSpec | None = None
    """Evaluates held-out problems ([eval], which it needs; one process on the CPU unless this section places
    it)."""
    custom: tuple[CustomRoleSpec, ...] = ()
    """Roles the framework does not know ([[roles.custom]])."""

    def __post_init__(self) -> None:
        check_fields(self)

    def items(self) -> list[tuple[str, RoleSpec | CustomRoleSpec]]:
        """Every role of the run, in rank order (training first: its rank 0 hosts the data plane)."""
        builtin = [(name, getattr(self, name)) for name in BUILTIN_ROLES if getattr(self, name) is not None]
        return builtin + [(c.name, c) for c in self.custom]


@dataclass(frozen=True)
class TopologySpec:
    """The machines a run spans ([topology]; one node by default)."""

    nodes: int = 1
    """How many nodes the run spans."""
    gpus_per_node: int | None = None
    """GPUs on each node (None: what a node has); a multi-node recipe with GPU roles names it, so its layout is
    fixed before any node starts."""
    addresses: tuple[str, ...] = ()
    """Each node's IP address (one per node), which its data-plane servers bind and advertise (empty: the address
    of the interface that routes to the rendezvous host)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 1 <= self.nodes <= MAX_NODES or (self.gpus_per_node is not None and self.gpus_per_node < 0):
            raise SchemaError(
                f"nodes: expected 1 to {MAX_NODES}, gpus_per_node >= 0, got {self.nodes}, {self.gpus_per_node}"
            )
        if self.addresses and len(self.addresses) != self.nodes:
            raise SchemaError(f"addresses: expected one per node ({self.nodes}), got {len(self.addresses)}")
        for address in self.addresses:
            try:
                ipaddress.ip_address(address)
            except ValueError:
                raise SchemaError(f"addresses: expected IP addresses, got {address!r}") from None


@dataclass(frozen=True)
class ModelSpec:
    """The policy model ([model]): its architecture, the weights it starts from and what it computes in."""

    name: str = "qwen3-tiny"
    """A meshy.train model (meshy.train.models), e.g. "qwen3-0.6b", "smollm2-135m"."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """What the model computes in, everywhere: training (mixed precision over float32 weights and optimizer
    state), the published weights, the inference and teacher engines."""
    init: str = "scratch"
    """"scratch", or the weights the first version starts from: an HF directory, "hf:<owner/name>" or
    "gguf:<name>" (meshy.recipes.weights.pretrained)."""
    overrides: dict = field(default_factory=dict)
    """Architecture fields to change (e.g. vocab_size for a task tokenizer)."""
    teacher: str | None = None
    """The teacher's weights, named as init's (distillation: algorithm.kind = "distill" needs it)."""
    lora: LoraConfig | None = None
    """[model.lora]: train low-rank adapters on the frozen policy instead of every weight, and publish each version as
    its adapters only (meshy.train.lora). The policy only: a critic is its own whole model (a copy of model.init
    with a value head) trained whole, and the teacher and the reference never take adapters."""

    def __post_init__(self) -> None:
        check_fields(self)
        self.arch()  # an unknown model name or override field fails here (model.init: recipe.checks)

    def arch(self):
        arch = get_model(self.name)
        known = {f.name for f in dataclasses.fields(arch)}
        unknown = sorted(set(self.overrides) - known)
        if unknown:
            raise SchemaError(f"overrides: unknown architecture fields {unknown}; expected some of {sorted(known)}")
        return dataclasses.replace(arch, **self.overrides)


@dataclass(frozen=True)
class TaskSpec:
    """What the run learns ([task]): the tokenizer, the problems and their reward, as import paths
    "package.module:name"."""

    tokenizer: str = "meshy.recipes.tasks.arithmetic:tokenizer"
    """The tokenizer factory, called with tokenizer_options."""
    problems: str = "meshy.recipes.tasks.arithmetic:problems"
    """The problem stream, called with a seed and options; problems have .prompt and .answer."""
    reward: str = "meshy.recipes.tasks.arithmetic:exact_match"
    """The reward function: (response text, ground truth) -> float. `meshy check` and `meshy run` try it first
    (meshy.recipes.usercode.task_trial): the right answer must get full marks (>= 1), an empty response a finite number.
    The right answer is the ground truth, or what the function's `perfect_response(ground_truth)` attribute
    writes (e.g. "Answer: 42"); `perfect_response = None`: a reward without a right answer, not tried on one."""
    options: dict = field(default_factory=dict)
    """Keyword arguments of the problem stream."""
    tokenizer_options: dict = field(default_factory=dict)
    """Keyword arguments of the tokenizer factory."""
    environment: str = ""
    """A multi-turn task's environment factory, called with tool_timeout_s (the recipe's [agent]) and
    environment_options for a fresh environment; its trajectories are rewarded by the environment, and `reward`
    is not used. Empty: single-turn."""
    environment_options: dict = field(default_factory=dict)
    """Keyword arguments of the environment factory."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("tokenizer", "problems", "reward") + ("environment",) * bool(self.environment):
            if ":" not in getattr(self, name):
                raise SchemaError(f"{name}: {getattr(self, name)!r} is not 'package.module:name'")


@dataclass(frozen=True)
class AgentSpec:
    """Multi-turn trajectories ([agent]; task.environment): the chat template that renders the conversation and
    its tool results, and the limits of a trajectory. A turn generates at most sampling.max_new_tokens tokens."""

    template: str = "qwen3"
    """The chat template: "qwen3", "minicpm5", "smollm2" or "plain" (meshy.recipes.prompts.chat_templates; qwen3
    and smollm2 render tools)."""
    enable_thinking: bool | None = None
    """The template's thinking switch: False ends Qwen3's generation prompt with an empty think block, True opens
    one in MiniCPM5's, None lets the model decide (SmolLM2 has no thinking mode: None only)."""
    max_turns: int = 4
    """Policy turns per trajectory (1 to 1000)."""
    max_tokens: int = 256
    """Policy and observation tokens per trajectory after the prompt (fewer than sampling.context_length)."""
    tool_timeout_s: float = 5.0
    """Seconds per tool call (finite, > 0)."""
    deadline_s: float = 120.0
    """Seconds per trajectory (wall clock, > 0)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.template not in TEMPLATES:
            raise SchemaError(f"template: unknown chat template {self.template!r}; expected one of {TEMPLATES}")
        if not 0 < self.tool_timeout_s < math.inf:
            raise SchemaError(f"tool_timeout_s: expected a finite number of seconds > 0, got {self.tool_timeout_s}")
        self.limits()

    def limits(self) -> AgentLimits:
        return AgentLimits(self.max_turns, self.max_tokens, self.deadline_s)


@dataclass(frozen=True)
class AlgorithmSpec:
    """How the policy learns ([algorithm]): the algorithm, its batches and pacing, and the training components'
    configs. Fields marked GRPO, PPO or distill apply to that kind only."""

    kind: Literal["grpo", "ppo", "distill"] = "grpo"
    """grpo (group baselines), ppo (a learned critic; needs a critic role) or distill (online policy
    distillation; needs a teacher role and model.teacher)."""
    group_size: int = 8
    """Rows (responses) sampled per prompt: one group."""
    prompts_per_step: int = 16
    """Groups per weights version, over all training ranks (split evenly over the training processes)."""
    pacing: int | str = 1
    """The window W of rollout ahead of training: 1 is on-policy lock-step, k bounded off-policy (rollout runs
    k - 1 versions ahead), "none" fully asynchronous."""
    max_staleness: int | None = None
    """Newest version minus a token's version beyond which the token is not trained (a row whose every token is
    older is dropped; older tokens inside a fresher row are masked out). None (left out): no limit."""
    minibatches: int = 1
    """Optimizer steps per pass over a version's rows (split evenly)."""
    epochs: int = 1
    """Passes over a version's rows (PPO epochs), each step clipped against the logprobs the version started
    from."""
    scale_by_std: bool = True
    """GRPO: a group's advantages (rewards minus the group mean) are divided by the group's reward std."""
    dynamic_sampling: bool = False
    """Rows of a group whose rewards are all equal are not trained (counted as dropped)."""
    tied_group_penalty: float = 0.0
    """GRPO: the advantage of a group whose rewards are all equal and below the best reward of the groups scored
    with it (the rollout scores up to 256 rows at once, as they are ready) is -tied_group_penalty, not 0: its
    policy keeps giving one wrong answer, and the push reopens sampling there
    (meshy.train.advantages.push_tied_groups). 0 is GRPO; not with dynamic_sampling. Which groups are scored
    together depends on timing, so a lock-step run with it need not replay exactly."""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty over the last overlong_buffer tokens of max_new_tokens (at most
    sampling.max_new_tokens), falling to -overlong_factor (GRPO: added to the reward; PPO: to the advantages after
    GAE, tail only, so the critic never learns it). 0 turns it off."""
    overlong_factor: float = 1.0
    """The overlong penalty at max_new_tokens (finite, >= 0)."""
    critic_warmup_versions: int = 0
    """PPO: the first versions only the critic learns: their rows are dropped ("critic warm-up") and the unchanged
    weights are published again."""
    initial_value: float = 0.5
    """PPO: the value head's bias at start, the mean reward."""
    value_clip: float = 0.2
    """PPO: the clipped value loss's range, values within value_clip of the old ones (> 0)."""
    gae_k: float = 0.5
    """PPO: per-sample GAE lambda = gae_k ** (1 / length), 0 < gae_k <= 1."""
    teacher_topk: int = 8
    """Distill: teacher top-k ids per token; set loss.distill_coef (and pg_coef 0 for pure distillation)."""
    routing_replay: bool = False
    """A mixture-of-experts model's trainer routes each response token to the experts the inference engine chose
    for it (the engine records them in the routed_experts column), so routing differences do not reach the
    importance ratio; needs an MoE model (either engine records them: TorchEngine always, SGLang when asked)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Which loss parts a policy step uses ([algorithm.loss]). loss.kl_coef: KL to the frozen initial policy (the
    weights of version 0), scored by a [roles.reference] section that the KL term needs."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The policy's optimizer ([algorithm.optim])."""
    critic_optim: OptimConfig = field(default_factory=OptimConfig)
    """PPO: the critic's optimizer ([algorithm.critic_optim])."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the training (and critic) processes split the model ([algorithm.parallel])."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.group_size < 1 or self.prompts_per_step < 1 or self.minibatches < 1 or self.epochs < 1:
            raise SchemaError(f"group_size, prompts_per_step, minibatches and epochs must be >= 1: {self}")
        if not (self.pacing == "none" or (isinstance(self.pacing, int) and self.pacing >= 1)):
            raise SchemaError(f'pacing: expected an int >= 1 or "none", got {self.pacing!r}')
        if not 0 < self.gae_k <= 1:
            raise SchemaError(f"gae_k: expected 0 < gae_k <= 1, got {self.gae_k}")
        if self.teacher_topk < 1 or not self.value_clip > 0:
            raise SchemaError(f"teacher_topk >= 1 and value_clip > 0, got {self.teacher_topk}, {self.value_clip}")
        if (self.max_staleness is not None and self.max_staleness < 0) or self.critic_warmup_versions < 0:
            raise SchemaError(
                f"max_staleness (or none), critic_warmup_versions: expected >= 0, got {self.max_staleness}, "
                f"{self.critic_warmup_versions}"
            )
        if not (math.isfinite(self.initial_value) and math.isfinite(self.overlong_factor)):
            raise SchemaError(
                f"initial_value, overlong_factor: expected finite numbers, got {self.initial_value}, "
                f"{self.overlong_factor}"
            )
        if not 0 <= self.tied_group_penalty < math.inf:
            raise SchemaError(f"tied_group_penalty: expected a finite value >= 0, got {self.tied_group_penalty}")
        if self.tied_group_penalty and (self.kind != "grpo" or self.dynamic_sampling):
            raise SchemaError(
                f'tied_group_penalty: pushes GRPO groups whose rewards are all equal; expected kind = "grpo" and '
                f"dynamic_sampling = false (it drops those groups), got kind = {self.kind!r}, "
                f"dynamic_sampling = {self.dynamic_sampling}"
            )
        if self.overlong_buffer < 0 or self.overlong_factor < 0:
            raise SchemaError(
                f"overlong_buffer, overlong_factor: expected >= 0, got {self.overlong_buffer}, {self.overlong_factor}"
            )

    @property
    def window(self) -> int | None:
        return None if self.pacing == "none" else int(self.pacing)


@dataclass(frozen=True)
class SamplingSpec:
    """How responses are generated ([sampling]): the engine and its sampling parameters."""

    max_new_tokens: int = 4
    """The most tokens a response (a turn, in a multi-turn run) generates."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling's probability mass, in (0, 1] (1: off)."""
    top_k: int = 0
    """Sample among the k likeliest tokens (0: off)."""
    max_in_flight: int = 64
    """Requests an engine generates at once."""
    context_length: int = 512
    """Prompt + response tokens of a request (> max_new_tokens, at most the model's max_position_embeddings); a
    longer prompt is an error row, and max_new_tokens shrinks to fit."""
    engine: Literal["torch", "sglang"] = "torch"
    """The engine of the inference, teacher and reference roles: "torch" (meshy.infer's TorchEngine) or "sglang"
    (SGLang, imported only when named)."""
    compile: bool = False
    """The torch engine's decode and sampler through torch.compile (SGLang compiles its own)."""
    keep_partial_every: int = 0
    """Write a response in progress to the data plane every this many tokens (0: never), so that a resumed run
    continues it from there instead of generating it again (with [dataplane] durable). Each chunk is a request of
    its own, prefilled again from its prefix, and a lock-step run on the torch engine then no longer starts its
    requests in waves (it does not replay token for token). Not in multi-turn runs."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_new_tokens < 1 or self.max_in_flight < 1 or self.context_length <= self.max_new_tokens:
            raise SchemaError(f"max_new_tokens, max_in_flight >= 1 and context_length > max_new_tokens: {self}")
        if self.keep_partial_every < 0:
            raise SchemaError(f"sampling.keep_partial_every: expected tokens >= 0, got {self.keep_partial_every}")
        if self.compile and self.engine != "torch":
            raise SchemaError(f'sampling.compile: applies to the torch engine, and sampling.engine is "{self.engine}"')
        self.params()  # the engines' own checks

    def params(self, seed: int | None = None) -> SamplingParams:
        """The engines' sampling settings for these responses (seed: the one a service derives each row's
        from; None: unseeded)."""
        return SamplingParams(self.max_new_tokens, self.temperature, self.top_p, self.top_k, seed=seed)


@dataclass(frozen=True)
class EvalSpec:
    """Held-out evaluation ([eval]), run by the eval role on published weights while training goes on: version 0,
    every `every`-th version and the last. Rollout never writes a problem whose prompt is among the held-out set.
    Answers are scored by task.reward; an answer is correct when it gets full marks (reward >= 1). metrics.jsonl
    gets eval/accuracy (correct answers), eval/pass@k (problems with a correct answer among their k, when
    samples = k > 1) and eval/reward per evaluated version."""

    every: int = 10
    """Versions between evaluations (version 0 and the last are evaluated too)."""
    count: int = 128
    """The held-out set: the first `count` distinct problems (by prompt) of `problems`; refused when the stream
    holds fewer."""
    seed: int = EVAL_SEED
    """The held-out stream's seed (default: the same set whatever the run's seed)."""
    problems: str = ""
    """The held-out problem stream, as an import path "package.module:name" (empty: task.problems)."""
    options: dict | None = None
    """Its keyword arguments (None: task.options)."""
    samples: int = 1
    """Answers per problem (more than one needs temperature > 0)."""
    temperature: float = 0.0
    """Sampling temperature of the answers (0: greedy, one answer)."""
    max_new_tokens: int = 0
    """The most tokens an answer generates (0: sampling.max_new_tokens)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.every < 1 or self.count < 1 or self.samples < 1:
            raise SchemaError(f"every, count, samples: expected >= 1, got {self.every}, {self.count}, {self.samples}")
        SamplingParams(self.max_new_tokens, self.temperature)  # the engines' own checks
        if self.samples > 1 and self.temperature == 0:
            raise SchemaError(
                f"samples: {self.samples} answers per problem need temperature > 0 (greedy answers are all the same)"
            )
        if self.problems and ":" not in self.problems:
            raise SchemaError(f"problems: {self.problems!r} is not 'package.module:name'")


TRACKERS = ("wandb", "mlflow", "trackio")  # [logging]'s fields, each the package it imports and its extra


@dataclass(frozen=True)
class LoggingSpec:
    """Experiment trackers beside metrics.jsonl and TensorBoard, which every run writes ([logging]; none by
    default): each one turned on gets every metrics line under the same names, at its weights version as the
    step, and the recipe as the run's config; its run is named after the run directory, and `meshy run
    --resume` carries it on (meshy.recipes.observe.metric_sinks; docs/experiment-tracking.md)."""

    project: str = ""
    """The trackers' project: wandb's project, MLflow's experiment, trackio's project (empty: the recipe's
    name)."""
    wandb: bool = False
    """Log to Weights & Biases (`pip install 'meshy-recipes[wandb]'`), in the run directory's wandb/;
    WANDB_MODE=offline keeps it there for `wandb sync`, and WANDB_ENTITY picks the team."""
    mlflow: bool = False
    """Log to MLflow (`pip install 'meshy-recipes[mlflow]'`), at mlflow_tracking_uri."""
    mlflow_tracking_uri: str = ""
    """Where MLflow runs go: a tracking server's URL or a database URI (empty: MLFLOW_TRACKING_URI, else a
    file store in the run directory's mlruns/)."""
    trackio: bool = False
    """Log to trackio (`pip install 'meshy-recipes[trackio]'`), in its local store (TRACKIO_DIR, by default
    ~/.cache/huggingface/trackio; TRACKIO_SPACE_ID or TRACKIO_SERVER_URL send it elsewhere)."""

    def __post_init__(self) -> None:
        check_fields(self)
        for tracker in TRACKERS:
            if getattr(self, tracker) and importlib.util.find_spec(tracker) is None:
                raise SchemaError(
                    f"{tracker}: true, but the {tracker} package is not installed; install it with "
                    f"`uv pip install 'meshy-recipes[{tracker}]'` (or `pip install 'meshy-recipes[{tracker}]'`)"
                )
        if self.mlflow_tracking_uri and not self.mlflow:
            raise SchemaError(
                f"mlflow_tracking_uri: {self.mlflow_tracking_uri!r} is where MLflow runs go, and mlflow is false; "
                "set mlflow = true, or remove it"
            )
        if len(self.project) > 128 or any(c in self.project for c in "/\\#?%:"):
            raise SchemaError(f"project: expected at most 128 characters, none of / \\ # ? % :, got {self.project!r}")


@dataclass(frozen=True)
class Recipe:
    """A whole run: the TOML file's top-level keys and its sections."""

    name: str
    """The run's name: its directory is run_dir/<name>-<timestamp>."""
    steps: int = 100
    """Weights versions to train."""
    seed: int = 0
    """The run's seed: the model's initialisation, and the seeds of rollout's problem streams and of sampling
    (one per process, derived from it)."""
    run_dir: str = "runs"
    """The directory in which run directories are made."""
    checkpoint_every: int = 0
    """Versions between checkpoints in the run directory's checkpoints/ (0: never). With rows kept on disk
    ([dataplane] durable), a version's rows are freed only once a checkpoint holds it, so that a resume trains
    them again instead of generating them again: the data plane holds up to this many versions' rows more."""
    checkpoint_in_background: bool = True
    """Write each checkpoint while the next versions train (the state is copied to host memory first, then
    written, hashed and renamed into place in the background; a failed write stops the run at the next
    checkpoint); false: write it before the next version trains."""
    stall_after_s: float = 300.0
    """A run in which no rows move and no version is published for this long prints what every task waits for
    and stops (meshy.recipes.launch.watchdog)."""
    publish: Transport = Transport.DISK
    """How weights reach inference: "disk" (HF directories), "shared-memory" (buckets on this host) or
    "collective" (buckets broadcast from training rank 0 to every inference process on a process group of their
    own, which SGLang engines' schedulers join themselves: meshy.recipes.roles.sync_group)."""
    delta: bool = False
    """With publish = "collective", send only what changed since the previous version (a whole one every 10th,
    and the next one whenever an engine could not rebuild a delta)."""
    hf_every: int = 0
    """Also keep every n-th version (0: none) as an HF directory in the run's hf_versions/, whatever `publish` is
    (the final weights are always kept)."""
    on_task_error: Literal["stop", "drop"] = "stop"
    """What the run does when the task's code (task.tokenizer, task.problems, task.reward,
    task.environment) raises, or the engine cannot generate a prompt the task made: "stop" ends the run
    within seconds, naming the field, the row and the traceback; "drop" drops the row (counted as dropped,
    with the error, in records and `meshy inspect`) and goes on."""
    colocate: tuple[tuple[str, ...], ...] = ()
    """Groups of roles that share devices by taking turns, through a GPU token ring (e.g.
    [["training", "inference"]]); each needs >= 2 roles with equal process counts."""
    share_devices: tuple[tuple[str, ...], ...] = ()
    """Groups of roles that share devices at the same time, each within its `memory_fraction` of every GPU (their
    fractions add up to at most 1)."""
    extra_columns: tuple[Column, ...] = ()
    """Columns added to the rollout table for custom roles ([[extra_columns]] name, dtype, shape)."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The policy model ([model])."""
    task: TaskSpec = field(default_factory=TaskSpec)
    """What the run learns ([task])."""
    algorithm: AlgorithmSpec = field(default_factory=AlgorithmSpec)
    """How the policy learns ([algorithm])."""
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    """How responses are generated ([sampling])."""
    agent: AgentSpec = field(default_factory=AgentSpec)
    """Multi-turn trajectories' template and limits ([agent])."""
    topology: TopologySpec = field(default_factory=TopologySpec)
    """The nodes the run spans ([topology]; one by default)."""
    roles: RolesSpec = field(default_factory=RolesSpec)
    """Where each role runs ([roles.<name>])."""
    dataplane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    """The data plane's servers and waits ([dataplane])."""
    eval: EvalSpec | None = None
    """Held-out evaluation ([eval]; none by default)."""
    logging: LoggingSpec = field(default_factory=LoggingSpec)
    """Experiment trackers beside metrics.jsonl and TensorBoard ([logging]; none by default)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.eval is not None and self.roles.eval is None:  # the role's default place: one CPU process
            object.__setattr__(self, "roles", dataclasses.replace(self.roles, eval=RoleSpec()))
        if self.steps < 1 or self.checkpoint_every < 0:
            raise SchemaError(f"steps >= 1 and checkpoint_every >= 0, got {self.steps}, {self.checkpoint_every}")
        if self.hf_every < 0:
            raise SchemaError(f"hf_every: expected >= 0 versions between kept HF directories, got {self.hf_every}")
        if not 0 < self.stall_after_s < math.inf:
            raise SchemaError(f"stall_after_s: expected a finite number of seconds > 0, got {self.stall_after_s}")

    @property
    def multi_turn(self) -> bool:
        """Whether the run's trajectories are multi-turn, played by an environment role."""
        return bool(self.task.environment)

    @property
    def eval_max_new_tokens(self) -> int:
        """The eval role's answer budget (eval.max_new_tokens, else sampling.max_new_tokens)."""
        assert self.eval is not None
        return self.eval.max_new_tokens or self.sampling.max_new_tokens

    @property
    def world_size(self) -> int:
        return sum(spec.processes for _, spec in self.roles.items())


def build(cls: type, data: Any, path: str) -> Any:
    """Turn parsed TOML into the dataclass `cls`, checking every field, naming any error's full path."""
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: expected a table, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SchemaError(f"{path}: unknown field {unknown[0]!r}; expected one of {sorted(fields)}")
    required = [name for name, f in fields.items() if f.default is f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise SchemaError(f"{path}: missing field {missing[0]!r}")
    hints = typing.get_type_hints(cls)
    values = {name: _value(hints[name], value, f"{path}.{name}") for name, value in data.items()}
    try:
        return cls(**values)
    except SchemaError as e:
        raise SchemaError(f"{path}: {e}") from None


def _value(annotation: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        return build(annotation, value, path)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _member(annotation, value, path)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if dataclasses.is_dataclass(a)]
        if inner and isinstance(value, dict):
            return build(inner[0], value, path)
        return value
    if origin is tuple and isinstance(value, list):
        item = args[0] if args else Any
        return tuple(_value(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    return value


def _member(choices: type[enum.Enum], value: Any, path: str) -> enum.Enum:
    """The member of `choices` whose value a recipe writes."""
    try:
        return choices(value)
    except (ValueError, TypeError):
        allowed = [member.value for member in choices]
        raise SchemaError(f"{path}: expected one of {allowed}, got {type(value).__name__} {value!r}") from None
