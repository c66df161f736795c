"""`meshy check` and `meshy run` try the recipe's task before any process starts (meshy.recipes.usercode.task_trial):
a tokenizer whose ids the model cannot hold, EOS ids that disagree, a reward that raises or does not give the
right answer full marks are refused naming the recipe field and the fix; a task module beside the recipe or
in the current directory imports, in `meshy check` and in a run's processes; every shipped recipe passes."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshy.dataplane import SchemaError
from meshy.recipes import cli
from meshy.recipes.prompts.problem import Problem
from meshy.recipes.recipe import DEFAULT_RECIPE, load_recipe
from meshy.recipes.recipe.catalog import shipped
from meshy.recipes.tasks import arithmetic, python_math
from meshy.recipes.usercode.task_trial import try_task

MEANS_REWARD = """
def reward(response, ground_truth):
    return 0.0  # nothing is ever right
"""
FUSSY_REWARD = """
def reward(response, ground_truth):
    digits = int(response)  # an empty response raises
    return float(str(digits) == ground_truth)
"""


def recipe_in(directory: Path, replace: dict[str, str] | None = None, steps: int = 2) -> Path:
    """The default recipe, `steps` versions without checkpoints, writing runs under `directory`; `replace`:
    lines of it to change (whole lines, by their start)."""
    text = DEFAULT_RECIPE.read_text()
    for start, line in {
        "steps = ": f"steps = {steps}",
        "run_dir = ": f'run_dir = "{directory / "runs"}"',
        "checkpoint_every = ": "",
        **(replace or {}),
    }.items():
        text, count = re.subn(rf"(?m)^{re.escape(start)}.*$", line, text)
        assert count == 1, start
    directory.mkdir(exist_ok=True)
    path = directory / "recipe.toml"
    path.write_text(text)
    return path


@pytest.fixture
def isolated(monkeypatch):
    """sys.path and sys.modules as they were after the test (task modules it imported from tmp dirs go)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("usertask"):
            del sys.modules[name]


def meshy(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


# ---- what is refused --------------------------------------------------------------------------
def test_meshy_check_refuses_a_vocabulary_smaller_than_the_tokenizer_s_ids(tmp_path, capsys, isolated):
    recipe = recipe_in(tmp_path, {"overrides = ": "overrides = { vocab_size = 6 }"})
    assert cli.main(["check", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert re.search(
        r"meshy: model.overrides.vocab_size = 6 but task.tokenizer produced id 16 for problem '\d\+\d=': "
        r"set vocab_size >= 17 \(task.tokenizer's vocab_size is 17\)",
        err,
    ), err


def test_meshy_run_refuses_it_before_torchrun_starts(tmp_path, capsys, isolated, monkeypatch):
    started = []
    monkeypatch.setattr("meshy.recipes.launch.run.Torchrun", lambda *a: started.append(a))
    recipe = recipe_in(tmp_path, {"overrides = ": "overrides = { vocab_size = 6 }"})
    assert cli.main(["run", str(recipe)]) == 2
    assert "model.overrides.vocab_size = 6 but task.tokenizer produced id 16" in capsys.readouterr().err
    assert not started and not (tmp_path / "runs").exists(), "no run directory, no process"


def test_the_model_s_eos_and_the_tokenizer_s_must_agree(tmp_path, capsys, isolated):
    recipe = recipe_in(tmp_path, {"overrides = ": "overrides = { vocab_size = 17, eos_token_id = 1 }"})
    assert cli.main(["check", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "model.overrides.eos_token_id: the engine ends a response (a turn) at the model's eos_token_id (1)" in err
    assert "task.tokenizer's eos_token_id is 2" in err and "set model.overrides.eos_token_id = 2" in err


def test_a_reward_that_raises_on_an_empty_response_is_refused_with_the_user_s_line(tmp_path, capsys, isolated):
    (tmp_path / "usertask_fussy.py").write_text(FUSSY_REWARD)
    recipe = recipe_in(tmp_path, {"reward = ": 'reward = "usertask_fussy:reward"'})
    assert cli.main(["check", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "meshy: task.reward: usertask_fussy:reward('', " in err and "(an empty response) raised ValueError" in err
    assert f'File "{tmp_path / "usertask_fussy.py"}", line 3, in reward\n    digits = int(response)' in err, err
    assert "task_trial.py" not in err, "the user's frames, not Meshy's"


def test_a_reward_that_never_gives_full_marks_is_refused(tmp_path, isolated):
    (tmp_path / "usertask_mean.py").write_text(MEANS_REWARD)
    recipe = load_recipe(recipe_in(tmp_path, {"reward = ": 'reward = "usertask_mean:reward"'}))
    sys.path.append(str(tmp_path))
    with pytest.raises(SchemaError) as refused:
        try_task(recipe)
    assert re.match(
        r"task.reward: usertask_mean:reward gave 0.0 to the right answer '\d' of problem '\d\+\d=' ", str(refused.value)
    )
    assert "the reward does not give the right answer full marks (>= 1.0" in str(refused.value)


def test_every_failure_is_said_at_once(tmp_path, isolated):
    (tmp_path / "usertask_mean2.py").write_text(MEANS_REWARD)
    recipe = recipe_in(
        tmp_path,
        {"overrides = ": "overrides = { vocab_size = 6 }", "reward = ": 'reward = "usertask_mean2:reward"'},
    )
    sys.path.append(str(tmp_path))
    with pytest.raises(
        SchemaError,
        match=r"(?s)the task failed 2 trials:\n1\. model.overrides.vocab_size = 6 .*\n2\. "
        r"task.reward: usertask_mean2:reward gave 0.0",
    ):
        try_task(load_recipe(recipe))


def test_a_missing_task_module_is_refused_saying_how_to_make_it_import(tmp_path, capsys, isolated):
    recipe = recipe_in(tmp_path, {"problems = ": 'problems = "usertask_nowhere:problems"'})
    assert cli.main(["check", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert (
        "task.problems: 'usertask_nowhere:problems': no module 'usertask_nowhere': expected usertask_nowhere.py "
        "beside the recipe or in the current directory, or its directory on PYTHONPATH" in err
    )


# ---- task modules beside the recipe -----------------------------------------------------------
def copy_of_arithmetic(directory: Path) -> dict[str, str]:
    """The arithmetic task as a user's module beside the recipe, and the recipe lines naming it."""
    (directory / "usertask_arith.py").write_text(Path(arithmetic.__file__).read_text())
    return {
        f"{f} = ": f'{f} = "usertask_arith:{name}"'
        for f, name in (("tokenizer", "tokenizer"), ("problems", "problems"), ("reward", "exact_match"))
    }


def test_meshy_check_imports_a_task_module_beside_the_recipe_from_another_directory(tmp_path):
    recipe_dir, elsewhere = tmp_path / "recipes", tmp_path / "elsewhere"
    recipe_dir.mkdir(), elsewhere.mkdir()
    recipe = recipe_in(recipe_dir, copy_of_arithmetic(recipe_dir))
    result = meshy("check", str(recipe), cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("arithmetic-tiny: qwen3-tiny")


# ---- multi-turn -------------------------------------------------------------------------------
def test_a_multi_turn_task_s_conversation_is_rendered_and_tokenized_against_the_model(tmp_path):
    from tests.recipes.test_agent_run import agent_recipe

    path = agent_recipe(tmp_path)
    path.write_text(re.sub(r"vocab_size = \d+", "vocab_size = 6", path.read_text()))
    with pytest.raises(SchemaError) as refused:
        try_task(load_recipe(path))
    assert re.match(
        r"model.overrides.vocab_size = 6 but task.tokenizer produced id \d+ for the conversation of problem 'say \d+'",
        str(refused.value),
    ), refused.value


@pytest.mark.usefixtures("sandboxes_alone")
def test_the_python_math_environment_scores_a_final_answer_without_its_end_of_turn():
    """What the trial found in qwen3-1.7b-python-math-8gpu: a final turn ends with <|im_end|>, which the dapo
    reward read as part of the answer (\\frac{1}{2}<|im_end|>), scoring a right answer 0."""
    import asyncio

    env = python_math.environment(tool_timeout_s=10, reward="dapo")
    problem = Problem("Compute 3/6.", "\\frac{1}{2}")

    async def final(turn: str) -> float:
        await env.reset(problem)
        return (await env.step(turn)).reward

    assert asyncio.run(final(env.perfect_answer(problem) + "<|im_end|>")) == 1.0
    assert asyncio.run(final("Answer: 3<|im_end|>")) == 0.0


# ---- every shipped recipe ---------------------------------------------------------------------
DATA_ROWS = {  # a few rows in each hub dataset's layout (meshy.recipes.tasks.math_data), for a machine without it
    "dapo": [
        {
            "prompt": [{"role": "user", "content": "What is 6*7? Answer: $Answer"}],
            "reward_model": {"ground_truth": "42"},
        },
        {"prompt": [{"role": "user", "content": "Halve 1."}], "reward_model": {"ground_truth": "\\frac{1}{2}"}},
    ],
    "gsm8k": [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"}],
    "ultradata": [{"query": "What is 2+3?", "ground_truth": "5", "domain": "Math"}],
}


def with_local_data(recipe, tmp_path: Path):
    """The recipe, its hub dataset (if any) replaced by a local file in the same layout."""
    options = recipe.task.options
    if "/" not in options.get("source", "") or Path(options["source"]).is_file():
        return recipe
    path = tmp_path / f"{options['format']}.parquet"
    pq.write_table(pa.Table.from_pylist(DATA_ROWS[options["format"]]), path)
    return dataclasses.replace(recipe, task=dataclasses.replace(recipe.task, options={**options, "source": str(path)}))


@pytest.mark.usefixtures("sandboxes_alone")  # qwen3-1.7b-python-math-8gpu's code tool probes the sandbox
@pytest.mark.parametrize("name", sorted(shipped()))
def test_every_shipped_recipe_passes_its_task_trial(name, tmp_path):
    recipe = with_local_data(load_recipe(shipped()[name]), tmp_path)
    notes = try_task(recipe, downloads=False)
    hub_tokenizer = recipe.task.tokenizer_options.get("model", "").startswith("hf:")
    if hub_tokenizer and notes:  # not tried without the hub (MiniCPM5's tokenizer), and said so
        assert (
            notes == [notes[0]]
            and notes[0].startswith("task.tokenizer: not tried here: ")
            and "`meshy run` " in notes[0]
        )
    else:
        assert notes == []


def test_meshy_check_says_what_it_did_not_try_without_the_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants

    recipe = load_recipe(shipped()["qwen3-1.7b-grpo-gsm8k-1gpu"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing downloaded
    (note,) = try_task(recipe, downloads=False)
    assert note.startswith("task.problems: not tried here: source: no file openai/gsm8k:")
    assert "it is not in this machine's hub cache, and downloads are off" in note
