"""A task's own code failing inside a real run: on_task_error = "stop" ends the run within seconds naming the
field, the row and the user's traceback, without resume advice; "drop" drops the rows and says why."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshy.recipes.recipe import DEFAULT_RECIPE
from meshy.recipes.usercode.task_errors import TASK_ERROR_FILE, TaskError, call_task, checked_reward

# Right on the ground truth and on an empty response (what `meshy check` tries), wrong on anything else.
TASK_MODULE = """
from meshy.recipes.tasks.arithmetic import exact_match, problems, tokenizer

SCORES = {"": 0.0}


def lookup_reward(response, truth):
    if response == truth:
        return 1.0
    return SCORES[response]


def digits_reward(response, truth):
    if response and not response.isdigit():
        raise ValueError(f"not a number: {response!r}")
    return exact_match(response, truth)
"""


def user_run(tmp_path: Path, reward: str, extra: str, steps: int) -> tuple[subprocess.CompletedProcess, Path, float]:
    """`meshy run` of the default recipe with the task module's `reward`, from tmp_path (where the module is)."""
    (tmp_path / "usertask.py").write_text(TASK_MODULE)
    recipe = DEFAULT_RECIPE.read_text()
    recipe = re.sub(r'(?m)^reward = ".*"$', f'reward = "usertask:{reward}"', recipe)
    recipe = re.sub(r"(?m)^steps = \d+$", f"steps = {steps}\n{extra}", recipe)
    recipe = re.sub(r"(?m)^checkpoint_every = .*$", "", recipe)
    (tmp_path / "recipe.toml").write_text(recipe)
    result = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "run", "recipe.toml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    ended = time.time()
    (run_dir,) = (tmp_path / "runs").iterdir()
    return result, run_dir, ended


def test_a_reward_that_raises_stops_the_run_within_seconds_naming_the_error_and_the_users_line(tmp_path):
    result, run_dir, ended = user_run(tmp_path, "lookup_reward", "", steps=50)
    assert result.returncode == 1, result.stderr[-3000:]
    report = run_dir / "logs" / TASK_ERROR_FILE
    assert ended - report.stat().st_mtime < 30, "the run went on after the reward raised"
    err = result.stderr
    assert "task.reward ('usertask:lookup_reward') raised KeyError" in err
    line = TASK_MODULE.splitlines().index("    return SCORES[response]") + 1
    assert f'usertask.py", line {line}, in lookup_reward\n    return SCORES[response]' in err, err[-3000:]
    assert re.search(r"on row \d+ \(response '.*', ground truth '\d+'\)", err)
    assert 'on_task_error = "drop"' in err
    assert "--resume" not in err  # a resume would fail the same way
    assert not (run_dir / "logs" / "stall.txt").exists()


def test_a_run_that_drops_rows_its_reward_raises_on_trains_on_and_says_why(tmp_path):
    result, run_dir, _ = user_run(tmp_path, "digits_reward", 'on_task_error = "drop"', steps=4)
    assert result.returncode == 0, result.stderr[-3000:]
    inspect = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "inspect", str(run_dir)], capture_output=True, text=True
    )
    assert inspect.returncode == 0, inspect.stderr
    dropped = re.search(r"task errors \(on_task_error = drop\): (\d+) rows dropped by rollout", inspect.stdout)
    assert dropped and int(dropped.group(1)) > 0, inspect.stdout
    assert len(re.findall(r"(?m)^  \d+ x task.reward", inspect.stdout)) <= 10  # the most frequent, then the rest
    assert "x task.reward ('usertask:digits_reward') raised ValueError: not a number:" in inspect.stdout
    trained = re.search(r"rows trained (\d+)", inspect.stdout)
    assert trained and int(trained.group(1)) > 0, inspect.stdout
    assert re.search(r"dropped: \d+ x task error: rollout dropped it", inspect.stdout), inspect.stdout


def users_reward(response: str, truth: str) -> float:
    return {"": 0.0}[response]


def test_call_task_names_the_field_the_row_and_shows_the_users_frames_not_ours():
    with pytest.raises(TaskError) as raised:
        call_task("task.reward", "m:users_reward", "on row 7", users_reward, "5", "5")
    error = raised.value
    assert error.field == "task.reward"
    assert error.summary == "task.reward ('m:users_reward') raised KeyError: '5'"
    text = str(error)
    assert text.startswith("task.reward ('m:users_reward') raised KeyError: '5' on row 7\n")
    assert 'in users_reward\n    return {"": 0.0}[response]' in text
    assert "call_task" not in text


@pytest.mark.parametrize("value", [None, "1", float("nan"), float("inf"), True])
def test_a_reward_that_is_not_a_finite_number_is_a_task_error(value):
    with pytest.raises(TaskError, match=r"task.reward \('m:r'\) returned .*; expected a finite float"):
        checked_reward(value, "m:r", "on row 1")
    assert checked_reward(1, "m:r", "on row 1") == 1.0
