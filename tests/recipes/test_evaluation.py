"""Held-out evaluation ([eval]): the recipe section, the held-out set kept out of training, the figures."""

import itertools

import pytest

from meshy.dataplane import SchemaError
from meshy.recipes.prompts.problem import Problem
from meshy.recipes.recipe import DEFAULT_RECIPE, EVAL_SEED, RoleSpec, load_recipe
from meshy.recipes.recipe.topology import assign
from meshy.recipes.tasks.arithmetic import problems
from meshy.recipes.usercode.held_out import MAX_SKIPPED_IN_A_ROW, WithoutHeldOut, evaluated, figures, held_out_problems

DEFAULT = DEFAULT_RECIPE.read_text()
WIDE = DEFAULT.replace("max_operand = 4", "max_operand = 9")  # 100 problems: room to hold some out


def recipe_from(tmp_path, text: str):
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return load_recipe(path)


def test_an_eval_section_adds_the_eval_role_on_one_cpu_process(tmp_path):
    recipe = recipe_from(tmp_path, WIDE + "\n[eval]\nevery = 50\ncount = 20\n")
    assert recipe.roles.eval == RoleSpec()
    assert [s.role for s in assign(recipe, recipe.world_size).values()] == ["training", "inference", "rollout", "eval"]
    assert recipe.eval.seed == EVAL_SEED and recipe.eval_max_new_tokens == recipe.sampling.max_new_tokens
    assert [v for v in range(recipe.steps + 1) if evaluated(recipe, v)] == list(range(0, recipe.steps + 1, 50))
    odd = recipe_from(tmp_path, WIDE.replace("steps = 800", "steps = 777") + "\n[eval]\nevery = 100\n")
    assert [v for v in range(778) if evaluated(odd, v)] == [*range(0, 777, 100), 777], "the last version too"


@pytest.mark.parametrize(
    ("tail", "needle"),
    [
        ("\n[eval]\nevery = 0\n", "recipe.eval: every, count, samples: expected >= 1"),
        ("\n[eval]\ncount = 0\n", "expected >= 1"),
        ("\n[eval]\nsamples = 4\n", "samples: 4 answers per problem need temperature > 0"),
        ("\n[eval]\ntemperature = -1.0\n", "temperature: expected a finite value >= 0 (0: greedy)"),
        ("\n[eval]\nproblems = 'mytask.problems'\n", "problems: 'mytask.problems' is not 'package.module:name'"),
        ("\n[eval]\nmax_new_tokens = 512\n", "eval.max_new_tokens: 512 tokens leave no room for a prompt"),
        ("\n[eval]\nevry = 5\n", "recipe.eval: unknown field 'evry'"),
        ("\n[roles.eval]\nprocesses = 1\n", "[roles.eval]: the eval role evaluates what an [eval] section describes"),
    ],
)
def test_a_bad_eval_section_is_refused_naming_the_field(tmp_path, tail, needle):
    with pytest.raises(SchemaError) as e:
        recipe_from(tmp_path, WIDE + tail)
    assert needle in str(e.value)


def test_the_held_out_set_is_the_eval_stream_s_first_problems_and_training_never_sees_one(tmp_path):
    recipe = recipe_from(tmp_path, WIDE + "\n[eval]\ncount = 30\n")
    held_out = held_out_problems(recipe)
    first: dict[str, Problem] = {}
    for problem in problems(EVAL_SEED, max_operand=9, ops="+"):
        first.setdefault(problem.prompt, problem)
        if len(first) == 30:
            break
    assert held_out == list(first.values()), "the first 30 distinct problems"
    prompts = {p.prompt for p in held_out}
    assert len(prompts) == 30
    too_many = recipe_from(tmp_path, WIDE + "\n[eval]\ncount = 101\n")
    with pytest.raises(SchemaError, match="held only 100 distinct prompts, short of 101; expected a smaller count"):
        held_out_problems(too_many)
    stream = WithoutHeldOut(problems(0, max_operand=9, ops="+"), held_out)
    training = list(itertools.islice(stream, 2000))
    assert not prompts & {p.prompt for p in training}
    assert stream.skipped > 300, "about a quarter of the draws were held out"
    assert len({p.prompt for p in training}) == 100 - len(prompts), "every other problem still comes"


def test_a_task_whose_every_problem_is_held_out_stops_naming_eval_count():
    everything = [Problem(f"{a}+{b}=", str(a + b)) for a in range(5) for b in range(5)]
    stream = WithoutHeldOut(problems(0, max_operand=4, ops="+"), everything)
    with pytest.raises(SchemaError, match=f"the last {MAX_SKIPPED_IN_A_ROW} training problems were all held out"):
        next(stream)


def test_figures_count_full_marks_as_correct():
    result = figures(7, [[1.0, 0.0], [0.5, 0.25], [1.0, 1.0]], 2.5)
    assert (result.accuracy, result.pass_at_k, result.problems, result.samples) == (0.5, 2 / 3, 3, 2)
    assert result.reward == pytest.approx(3.75 / 6)
    line = result.metrics()
    assert line["version"] == 7 and line["eval/accuracy"] == 0.5 and line["eval/pass@2"] == pytest.approx(2 / 3)
    assert "eval/pass@1" not in figures(1, [[1.0], [0.0]], 0.1).metrics()
    with pytest.raises(SchemaError, match="expected finite rewards"):
        figures(1, [[float("nan")]], 0.1)
