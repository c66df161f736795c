"""The tasks declared beside the rollout columns form a flow in which every read column has a writer."""

from meshy.dataplane import columns as cols

EVERY_OPTION = (
    cols.PROMPTS_TASK,
    cols.generate_with(routed_experts=True),
    cols.REWARD_TASK,
    cols.advantage_with(values=True),
    cols.CRITIC_VALUES_TASK,
    cols.CRITIC_TRAIN_TASK,
    cols.TEACHER_TASK,
    cols.REFERENCE_TASK,
    cols.train_with(reward=True, teacher=True, reference=True, routed_experts=True),
)


def test_with_every_option_each_read_column_has_a_writer_and_is_a_column_of_the_table():
    assert cols.unwritten(EVERY_OPTION) == []
    table = {c.name for c in cols.rollout_table(teacher_topk=2, routed_experts=(1, 1)).columns}
    assert {c for task in EVERY_OPTION for c in task.reads + task.writes} <= table


def test_a_missing_writer_names_each_task_that_reads_its_columns():
    without_reward = [t for t in EVERY_OPTION if t.name != cols.REWARD_TASK.name]
    assert [(task.name, column) for task, column in cols.unwritten(without_reward)] == [
        ("advantage", cols.REWARD),
        ("train", cols.REWARD),
    ]


def test_options_add_columns_to_the_same_task():
    replayed = cols.train_with(routed_experts=True)
    assert replayed.name == cols.TRAIN_TASK.name and replayed.reads == (*cols.TRAIN_TASK.reads, cols.ROUTED_EXPERTS)
    assert cols.advantage_with(values=False) == cols.ADVANTAGE_TASK
    assert cols.VALUES in cols.advantage_with(values=True).reads and cols.RETURNS in cols.advantage_with(True).writes


def test_rows_wait_for_the_tasks_that_retire_them():
    spec = cols.rollout_table(tasks=(*EVERY_OPTION, cols.TRAIN_TASK))  # one name, once
    assert spec.retire_after == ("critic_train", "train")
