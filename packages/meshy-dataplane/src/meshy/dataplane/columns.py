"""The rollout table: the columns RL roles exchange and the tasks that read and write them, defined once.

The whole data flow, one task per edge (a task leases rows whose `reads` are ready, adds its `writes`,
and acks; rows are freed once every task that `retires` them acked them):

  prompts        ->  prompt_ids, ground_truth             (rollout puts new rows; it leases nothing)
  generate       prompt_ids -> response_ids, rollout_logprobs, token_versions, finish_reason, truncated,
                 error (+ routed_experts when the run replays a mixture-of-experts model's routing)
  reward         response_ids, ground_truth, error -> reward     (per row; NaN: the row is dropped)
  advantage      reward, response_ids, whole groups -> advantage
                 (with a critic: + values -> + returns, GAE)
  critic_values  prompt_ids, response_ids -> values
  critic_train   prompt_ids, response_ids, values, returns              retires rows
  teacher        prompt_ids, response_ids -> teacher_topk_ids, teacher_topk_logprobs  (distillation)
  reference      prompt_ids, response_ids -> ref_logprobs               (KL to the reference policy)
  train          prompt_ids, response_ids, rollout_logprobs, token_versions, advantage, whole groups
                 (+ reward to report it, + the teacher's top-k, + ref_logprobs, + routed_experts,
                 + policy_mask)                                         retires rows

Per-token columns are aligned with response_ids. routed_experts [response tokens, layers, top_k] int16:
entry i is the experts every MoE layer chose at the position whose logits gave response token i (the
prompt's last position for token 0), the routing the trainer replays there. Only a table made for
routing replay declares it: dense models, and runs that do not replay, carry no such column at all, so
no row pays for it and no consumer has to tell an empty value from a missing one.

policy_mask [response tokens] bool, in a table made for multi-turn trajectories only: a trajectory's
response is the policy's tokens and the observations' tokens in turn (meshy.recipes.agents.trajectory),
and the mask marks the policy's. Observation tokens carry 0.0 logprobs and version -1; nothing trains
on them.

Multi-turn runs replace generate and reward by an environment role, and generation moves to a second
table, `turns`, with one row per policy turn:

  prompts        ->  problem, ground_truth                (rollout)
  agent          problem, ground_truth -> prompt_ids, then (once the trajectory has ended) response_ids,
                 rollout_logprobs, token_versions, finish_reason, truncated, error, policy_mask, reward
  turns: generate   prompt_ids (the sequence so far), max_new_tokens -> response_ids, rollout_logprobs,
                    token_versions, finish_reason, truncated, error           (inference, unchanged)
  turns: observe    the turn and the trajectory so far -> the next turn's row, or the trajectory's
                    columns in the rollout table                              retires turn rows

A turn row carries the whole trajectory so far (its tokens in prompt_ids, their mask, logprobs and
versions in policy_mask, history_logprobs and history_versions, the rest in the `trajectory` JSON), so
any environment process can take the next step of any trajectory, and a process that dies loses
nothing but the step it was taking (its lease expires and another process takes the turn again).
"""

from collections.abc import Iterable
from dataclasses import dataclass, replace

from meshy.dataplane.schema import Column, TableSpec

PROMPT_IDS = "prompt_ids"
GROUND_TRUTH = "ground_truth"
RESPONSE_IDS = "response_ids"
ROLLOUT_LOGPROBS = "rollout_logprobs"
TOKEN_VERSIONS = "token_versions"
FINISH_REASON = "finish_reason"
TRUNCATED = "truncated"
ERROR = "error"
REWARD = "reward"
ADVANTAGE = "advantage"
RETURNS = "returns"
VALUES = "values"
REF_LOGPROBS = "ref_logprobs"
TEACHER_TOPK_IDS = "teacher_topk_ids"
TEACHER_TOPK_LOGPROBS = "teacher_topk_logprobs"
ROUTED_EXPERTS = "routed_experts"
POLICY_MASK = "policy_mask"
PROBLEM = "problem"
MAX_NEW_TOKENS = "max_new_tokens"
TRAJECTORY = "trajectory"
HISTORY_LOGPROBS = "history_logprobs"
HISTORY_VERSIONS = "history_versions"
PARTIAL_OF = "partial_of"
# A generation in progress is kept in chunks, each a row of the partials table with id partial_row_id(row, chunk).
MAX_PARTIAL_CHUNKS = 1 << 16


@dataclass(frozen=True)
class Task:
    """A consumer of the rollout table: it leases rows whose `reads` are all ready and adds its
    `writes` to them. retires: rows are not freed before this task acked them."""

    name: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    retires: bool = False

    def plus(self, reads: tuple[str, ...] = (), writes: tuple[str, ...] = ()) -> "Task":
        """The same task reading and writing more columns (what a run's options add to it)."""
        return replace(self, reads=self.reads + reads, writes=self.writes + writes)


PROMPTS_TASK = Task("prompts", writes=(PROMPT_IDS, GROUND_TRUTH))
GENERATE_TASK = Task(
    "generate",
    reads=(PROMPT_IDS,),
    writes=(RESPONSE_IDS, ROLLOUT_LOGPROBS, TOKEN_VERSIONS, FINISH_REASON, TRUNCATED, ERROR),
)
REWARD_TASK = Task("reward", reads=(RESPONSE_IDS, GROUND_TRUTH, ERROR), writes=(REWARD,))
ADVANTAGE_TASK = Task("advantage", reads=(REWARD, RESPONSE_IDS), writes=(ADVANTAGE,))
CRITIC_VALUES_TASK = Task("critic_values", reads=(PROMPT_IDS, RESPONSE_IDS), writes=(VALUES,))
CRITIC_TRAIN_TASK = Task("critic_train", reads=(PROMPT_IDS, RESPONSE_IDS, VALUES, RETURNS), retires=True)
TEACHER_TASK = Task("teacher", reads=(PROMPT_IDS, RESPONSE_IDS), writes=(TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS))
REFERENCE_TASK = Task("reference", reads=(PROMPT_IDS, RESPONSE_IDS), writes=(REF_LOGPROBS,))
TRAIN_TASK = Task("train", reads=(PROMPT_IDS, RESPONSE_IDS, ROLLOUT_LOGPROBS, TOKEN_VERSIONS, ADVANTAGE), retires=True)
# multi-turn runs
PROBLEMS_TASK = Task("prompts", writes=(PROBLEM, GROUND_TRUTH))
AGENT_TASK = Task(
    "agent",
    reads=(PROBLEM, GROUND_TRUTH),
    writes=(PROMPT_IDS, *GENERATE_TASK.writes, POLICY_MASK, REWARD),
)
TURN_GENERATE_TASK = GENERATE_TASK.plus(reads=(MAX_NEW_TOKENS,))
OBSERVE_TASK = Task(
    "observe",
    reads=(TRAJECTORY, PROMPT_IDS, POLICY_MASK, HISTORY_LOGPROBS, HISTORY_VERSIONS, *GENERATE_TASK.writes),
    retires=True,
)


def generate_with(routed_experts: bool = False) -> Task:
    """GENERATE_TASK, also recording the engine's routing when the run replays it."""
    return GENERATE_TASK.plus(writes=(ROUTED_EXPERTS,) if routed_experts else ())


def advantage_with(values: bool = False, policy_mask: bool = False) -> Task:
    """ADVANTAGE_TASK; over a critic's values (GAE) it also writes the returns the critic trains on, and
    with policy_mask (multi-turn) it steps over the policy's tokens only."""
    task = ADVANTAGE_TASK.plus(reads=(VALUES,), writes=(RETURNS,)) if values else ADVANTAGE_TASK
    return task.plus(reads=(POLICY_MASK,)) if policy_mask else task


def train_with(
    reward: bool = False,
    teacher: bool = False,
    reference: bool = False,
    routed_experts: bool = False,
    policy_mask: bool = False,
) -> Task:
    """TRAIN_TASK plus what the run's loss and reports need: the reward (reported), the teacher's top-k
    (distillation), the reference's logprobs (KL), the engine's routing (replay), which tokens are the
    policy's (multi-turn)."""
    extra = (REWARD,) * reward + TEACHER_TASK.writes * teacher + REFERENCE_TASK.writes * reference
    return TRAIN_TASK.plus(reads=extra + (ROUTED_EXPERTS,) * routed_experts + (POLICY_MASK,) * policy_mask)


def unwritten(tasks: Iterable[Task]) -> list[tuple[Task, str]]:
    """(task, column) for every column a task reads that none of `tasks` writes: rows would wait for
    it forever."""
    tasks = tuple(tasks)
    written = {column for task in tasks for column in task.writes}
    return [(task, column) for task in tasks for column in task.reads if column not in written]


# what the inference role writes for a row it generates, in either table
GENERATED_COLUMNS = (
    Column(RESPONSE_IDS, "int64", (None,)),
    Column(ROLLOUT_LOGPROBS, "float32", (None,)),
    Column(TOKEN_VERSIONS, "int64", (None,)),
    Column(FINISH_REASON, "str"),
    Column(TRUNCATED, "bool"),
    Column(ERROR, "str"),
)


def rollout_table(
    name: str = "rollout",
    group_size: int = 1,
    teacher_topk: int = 0,
    routed_experts: tuple[int, int] | None = None,
    tasks: Iterable[Task] = (),
    max_row_bytes: int = 64 << 20,
    multi_turn: bool = False,
) -> TableSpec:
    """tasks: the run's tasks; a row is freed once every one of them that `retires` rows acked it.
    multi_turn: rows are multi-turn trajectories (policy_mask and problem columns)."""
    ragged_int, ragged_float = (None,), (None,)
    columns = [
        Column(PROMPT_IDS, "int64", ragged_int),
        Column(GROUND_TRUTH, "str"),
        *GENERATED_COLUMNS,
        Column(REWARD, "float32"),
        Column(ADVANTAGE, "float32", ragged_float),
        Column(RETURNS, "float32", ragged_float),
        Column(VALUES, "float32", ragged_float),
        Column(REF_LOGPROBS, "float32", ragged_float),
    ]
    if teacher_topk:
        columns += [
            Column(TEACHER_TOPK_IDS, "int64", (None, teacher_topk)),
            Column(TEACHER_TOPK_LOGPROBS, "float32", (None, teacher_topk)),
        ]
    if routed_experts is not None:  # (MoE layers, experts per token)
        columns.append(Column(ROUTED_EXPERTS, "int16", (None, *routed_experts)))
    if multi_turn:
        columns += [Column(POLICY_MASK, "bool", ragged_int), Column(PROBLEM, "str")]
    retire_after = tuple(dict.fromkeys(task.name for task in tasks if task.retires))
    return TableSpec(
        name, tuple(columns), group_size=group_size, max_row_bytes=max_row_bytes, retire_after=retire_after
    )


def partials_table(
    name: str = "partials", routed_experts: tuple[int, int] | None = None, max_row_bytes: int = 64 << 20
) -> TableSpec:
    """Generations in progress, kept as they are produced: one row per chunk of a rollout row's response
    (`partial_of`: that row's id), with the chunk's tokens, logprobs and versions (and routing). The inference
    service writes a chunk every so many tokens and drops a row's chunks once its response is written; a
    resumed run continues each row from the chunks it finds. No task consumes them."""
    ragged_int = (None,)
    columns = (
        Column(PARTIAL_OF, "int64"),
        Column(RESPONSE_IDS, "int64", ragged_int),
        Column(ROLLOUT_LOGPROBS, "float32", ragged_int),
        Column(TOKEN_VERSIONS, "int64", ragged_int),
    )
    if routed_experts is not None:
        columns += (Column(ROUTED_EXPERTS, "int16", (None, *routed_experts)),)
    return TableSpec(name, columns, max_row_bytes=max_row_bytes)


def partial_row_id(row: int, chunk: int) -> int:
    """The partials table's row id of chunk `chunk` (0, 1, ...) of rollout row `row`'s response."""
    if not 0 <= chunk < MAX_PARTIAL_CHUNKS:
        raise ValueError(f"chunk {chunk} of row {row}: expected 0 to {MAX_PARTIAL_CHUNKS - 1}")
    return row * MAX_PARTIAL_CHUNKS + chunk


def turns_table(name: str = "turns", max_row_bytes: int = 64 << 20) -> TableSpec:
    """One row per policy turn of a multi-turn trajectory (see the module's doc); freed once observed."""
    ragged_int, ragged_float = (None,), (None,)
    columns = (
        Column(TRAJECTORY, "str"),
        Column(PROMPT_IDS, "int64", ragged_int),
        Column(MAX_NEW_TOKENS, "int64"),
        Column(POLICY_MASK, "bool", ragged_int),
        Column(HISTORY_LOGPROBS, "float32", ragged_float),
        Column(HISTORY_VERSIONS, "int64", ragged_int),
        *GENERATED_COLUMNS,
    )
    return TableSpec(name, columns, max_row_bytes=max_row_bytes, retire_after=(OBSERVE_TASK.name,))
