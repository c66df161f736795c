"""A recipe's tasks: each column one of them reads is written by another, whatever the algorithm; a
custom role that reads a column nobody writes is refused by `meshy check`."""

import itertools

import pytest

from meshy.dataplane import SchemaError
from meshy.dataplane import columns as cols
from meshy.recipes.cli import main
from meshy.recipes.recipe import DEFAULT_RECIPE, load_recipe
from meshy.recipes.recipe.dataflow import recipe_tasks, rollout_table

DEFAULT = DEFAULT_RECIPE.read_text()


def variant(kind: str, kl: bool, replay: bool) -> str:
    text = DEFAULT.replace('kind = "grpo"', f'kind = "{kind}"')
    if kind == "ppo":
        text += "\n[roles.critic]\nprocesses = 1\n"
    if kind == "distill":
        text = text.replace("[model]\n", '[model]\nteacher = "hf:Qwen/Qwen3-0.6B"\n') + "\n[roles.teacher]\n"
    if kl:
        text = text.replace("[algorithm.loss]", "[algorithm.loss]\nkl_coef = 0.05") + "\n[roles.reference]\n"
    if replay:
        text = text.replace('name = "qwen3-tiny"', 'name = "qwen3-tiny-moe"')
        text = text.replace("pacing = 1", "pacing = 1\nrouting_replay = true")
    return text


def load(tmp_path, text: str):
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return load_recipe(path)


@pytest.mark.parametrize(("kind", "kl", "replay"), list(itertools.product(("grpo", "ppo", "distill"), (0, 1), (0, 1))))
def test_every_column_a_task_reads_has_a_writer_and_a_place_in_the_table(tmp_path, kind, kl, replay):
    recipe = load(tmp_path, variant(kind, bool(kl), bool(replay)))
    tasks = {task.name: task for task in recipe_tasks(recipe)}
    assert cols.unwritten(tasks.values()) == []
    table = rollout_table(recipe)
    assert {c for task in tasks.values() for c in task.reads + task.writes} <= {c.name for c in table.columns}
    assert table.retire_after == (("train", "critic_train") if kind == "ppo" else ("train",))
    train = set(tasks["train"].reads)
    assert (cols.TEACHER_TOPK_IDS in train) == (kind == "distill") and (cols.REF_LOGPROBS in train) == bool(kl)
    assert (cols.VALUES in tasks["advantage"].reads) == (kind == "ppo")
    assert (cols.ROUTED_EXPERTS in train) == (cols.ROUTED_EXPERTS in tasks["generate"].writes) == bool(replay)


JUDGE = '\n[[roles.custom]]\nname = "judge"\ncls = "tests.recipes.custom_role:LengthScorer"\ntask = "judging"\n'
SCORER = (
    '\n[[roles.custom]]\nname = "scorer"\ncls = "tests.recipes.custom_role:LengthScorer"\ntask = "length_scorer"\n'
    'options = { column = "rm_score" }\nreads = ["response_ids"]\nwrites = ["rm_score"]\n'
)
RM_SCORE = '\n[[extra_columns]]\nname = "rm_score"\ndtype = "float32"\n'


def test_meshy_check_refuses_a_custom_role_that_reads_a_column_nobody_writes(tmp_path, capsys):
    path = tmp_path / "recipe.toml"
    path.write_text(DEFAULT + JUDGE + 'options = { column = "rm_score" }\nreads = ["rm_score"]\n' + RM_SCORE)
    assert main(["check", str(path)]) == 2
    error = capsys.readouterr().err
    assert (
        "roles.custom.judge.reads: task 'judging' reads column 'rm_score', which no task of this recipe writes" in error
    )
    assert "expected a role that writes it" in error


def test_a_custom_role_may_read_what_another_custom_role_writes_and_both_retire_rows(tmp_path, capsys):
    path = tmp_path / "recipe.toml"
    judge = JUDGE + 'options = { column = "verdict" }\nreads = ["rm_score", "reward"]\nwrites = ["verdict"]\n'
    path.write_text(DEFAULT + SCORER + judge + RM_SCORE + '\n[[extra_columns]]\nname = "verdict"\ndtype = "float32"\n')
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    assert rollout_table(load_recipe(path)).retire_after == ("train", "length_scorer", "judging")


@pytest.mark.parametrize(
    ("custom", "needle"),
    [
        (
            SCORER.replace('writes = ["rm_score"]', 'writes = ["reward"]'),
            "roles.custom.scorer.writes: column 'reward' is not one of the [[extra_columns]] ['rm_score']",
        ),
        (SCORER.replace('task = "length_scorer"\n', ""), "custom role scorer: reads, writes: columns are read and"),
        (SCORER.replace('reads = ["response_ids"]', 'reads = "response_ids"'), "CustomRoleSpec.reads: expected tuple"),
    ],
)
def test_a_custom_role_s_reads_and_writes_are_checked_at_load(tmp_path, custom, needle):
    with pytest.raises(SchemaError) as error:
        load(tmp_path, DEFAULT + custom + RM_SCORE)
    assert needle in str(error.value)
