"""A recipe's data flow: the tasks its roles run over the rollout table (declared, with the columns they
read and write, in meshy.dataplane.columns), the table they share, and the check that every column one
of them reads is written by another, so no row waits forever for a column nobody writes."""

from meshy.dataplane import SchemaError, TableSpec
from meshy.dataplane import columns as cols
from meshy.recipes.recipe.spec import Recipe

TURNS = cols.turns_table().name  # a multi-turn run's second table: one row per policy turn
PARTIALS = cols.partials_table().name  # responses in progress, with sampling.keep_partial_every


def recipe_tasks(recipe: Recipe) -> tuple[cols.Task, ...]:
    """The built-in tasks the recipe's algorithm runs, then one per custom role that names a task. A
    multi-turn run's environment role takes the place of generate and reward (its turns are generated
    in a table of their own: meshy.dataplane.columns)."""
    algo = recipe.algorithm
    replay, critic, distill = algo.routing_replay, algo.kind == "ppo", algo.kind == "distill"
    if recipe.multi_turn:
        tasks = [cols.PROBLEMS_TASK, cols.AGENT_TASK]
    else:
        tasks = [cols.PROMPTS_TASK, cols.generate_with(routed_experts=replay), cols.REWARD_TASK]
    tasks += [
        cols.advantage_with(values=critic, policy_mask=critic and recipe.multi_turn),
        cols.train_with(
            reward=True,
            teacher=distill,
            reference=algo.loss.kl_coef > 0,
            routed_experts=replay,
            policy_mask=recipe.multi_turn,
        ),
    ]
    if critic:
        tasks += [cols.CRITIC_VALUES_TASK, cols.CRITIC_TRAIN_TASK]
    if distill:
        tasks.append(cols.TEACHER_TASK)
    if recipe.roles.reference is not None:
        tasks.append(cols.REFERENCE_TASK)
    tasks += [cols.Task(c.task, c.reads, c.writes, retires=True) for c in recipe.roles.custom if c.task]
    return tuple(tasks)


def check_dataflow(recipe: Recipe) -> None:
    """Custom roles write only their own [[extra_columns]], and every column a task reads has a writer."""
    extra = [c.name for c in recipe.extra_columns]
    for role in recipe.roles.custom:
        for column in role.writes:
            if column not in extra:
                raise SchemaError(
                    f"roles.custom.{role.name}.writes: column {column!r} is not one of the [[extra_columns]] "
                    f"{extra}; expected a column declared there (built-in columns have their built-in writers)"
                )
    tasks = recipe_tasks(recipe)
    custom = {c.task: c.name for c in recipe.roles.custom if c.task}
    missing = cols.unwritten(tasks)
    if missing:
        task, column = missing[0]
        where = f"roles.custom.{custom[task.name]}.reads" if task.name in custom else f"task {task.name!r}"
        raise SchemaError(
            f"{where}: task {task.name!r} reads column {column!r}, which no task of this recipe writes; expected "
            f"a role that writes it (a [[roles.custom]] with {column!r} in its writes); the tasks write "
            f"{sorted({c for t in tasks for c in t.writes})}"
        )


def rollout_table(recipe: Recipe) -> TableSpec:
    """The run's one table: the shared rollout columns (routed_experts when the run replays routing) and
    the recipe's extra columns. A row is freed once every task that retires rows acked it: training's,
    the critic's, and every custom role's that names a task."""
    algo = recipe.algorithm
    arch = recipe.model.arch()
    base = cols.rollout_table(
        group_size=algo.group_size,
        teacher_topk=algo.teacher_topk if algo.kind == "distill" else 0,
        routed_experts=(arch.num_hidden_layers, arch.num_experts_per_tok) if algo.routing_replay else None,
        tasks=recipe_tasks(recipe),
        multi_turn=recipe.multi_turn,
    )
    return TableSpec(
        base.name, (*base.columns, *recipe.extra_columns), base.group_size, base.max_row_bytes, base.retire_after
    )


def tables(recipe: Recipe) -> list[TableSpec]:
    """Every table of the run: the rollout table, the turns table of a multi-turn run, and the partials table
    of a run that keeps responses in progress."""
    partials = []
    if recipe.sampling.keep_partial_every:
        arch = recipe.model.arch()
        routed = (arch.num_hidden_layers, arch.num_experts_per_tok) if recipe.algorithm.routing_replay else None
        partials.append(cols.partials_table(routed_experts=routed))
    return [rollout_table(recipe)] + [cols.turns_table()] * recipe.multi_turn + partials
