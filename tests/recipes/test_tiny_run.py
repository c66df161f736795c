"""A real tiny run of the embedded default, shrunk with --set (real torchrun, real processes), as a user runs
their own task: its module beside the recipe, started from another directory. What it shows while it
starts, the recipe its directory keeps, `meshy run --resume` carrying it on, `meshy sample` answering with
its weights (from yet another directory), and its curve's title."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from meshy.recipes.observe.sample import task_prompt
from meshy.recipes.recipe import DEFAULT_RECIPE, load_recipe
from meshy.recipes.recipe.catalog import shipped
from meshy.recipes.tasks import arithmetic
from meshy.recipes.tasks.math import MathOptions
from meshy.recipes.tasks.reasoning_gym import ReasoningGymOptions

SETS = ["steps=2", "checkpoint_every=2", "algorithm.prompts_per_step=4", "algorithm.group_size=4"]
PHASES = [
    "processes started",
    "data plane up",
    "training built",
    "version 0 published",
    "inference engine built",
    "first batch ready to train",
]
START_UP = re.compile(r"^meshy: start-up: (.+) \((\d+\.\d) s\)$", re.M)


def meshy(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "meshy.recipes.cli", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`meshy run recipes/recipe.toml --set steps=2 ...` from elsewhere/ (runs go to its runs/), the recipe's
    task a module beside it (a copy of the arithmetic task): the run directory and what the run printed."""
    base = tmp_path_factory.mktemp("tiny")
    recipes, elsewhere = base / "recipes", base / "elsewhere"
    recipes.mkdir(), elsewhere.mkdir()
    (recipes / "usertask_arith.py").write_text(Path(arithmetic.__file__).read_text())
    text = DEFAULT_RECIPE.read_text().replace('"meshy.recipes.tasks.arithmetic:', '"usertask_arith:')
    (recipes / "recipe.toml").write_text(text)
    result = meshy("run", str(recipes / "recipe.toml"), *(a for s in SETS for a in ("--set", s)), cwd=elsewhere)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (run_dir,) = (elsewhere / "runs").iterdir()
    return run_dir, result


def test_a_run_s_processes_import_a_task_module_beside_the_recipe(tiny_run):
    run_dir, _ = tiny_run
    assert load_recipe(run_dir / "recipe.toml").task.reward == "usertask_arith:exact_match"
    versions = [json.loads(line)["version"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert versions == [1, 2]


def test_a_run_says_each_start_up_phase_as_it_is_done_before_the_first_version(tiny_run):
    _, result = tiny_run
    phases = START_UP.findall(result.stdout)
    assert [name for name, _ in phases] == PHASES
    seconds = [float(s) for _, s in phases]
    assert seconds == sorted(seconds) and seconds[0] > 0
    assert result.stdout.index("first batch ready to train") < result.stdout.index("step    1/2")
    # the checkpoint at version 2 was written by one training process, without DCP's single-process warning
    assert "UserWarning" not in result.stderr and "torch.distributed is disabled" not in result.stderr
    assert "Setting OMP_NUM_THREADS" not in result.stdout + result.stderr  # torchrun's banner about threads


@pytest.mark.slow  # a second run's start-up (test_overrides resumes in-process, without torchrun)
def test_the_run_directory_keeps_the_recipe_as_run_and_resume_carries_it_on(tiny_run):
    run_dir, _ = tiny_run
    kept = load_recipe(run_dir / "recipe.toml")
    assert (kept.steps, kept.checkpoint_every, kept.algorithm.prompts_per_step, kept.algorithm.group_size) == (
        2,
        2,
        4,
        4,
    )
    assert (run_dir / "recipe.toml").read_text().splitlines()[0].endswith(" ".join(f"--set {s}" for s in SETS))
    refused = meshy("run", "--resume", str(run_dir), "--set", "steps=3")
    assert refused.returncode == 2 and "--set with --resume" in refused.stderr
    # The run's last checkpoint is its last version: resumed with its own recipe (2 steps, not the file's
    # 800) the run restores version 2 and finishes, training nothing more.
    resumed = meshy("run", "--resume", str(run_dir), timeout=180)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "meshy: start-up: version 2 (the newest checkpoint's) published" in resumed.stdout
    assert "step " not in resumed.stdout and "UserWarning" not in resumed.stderr
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["version"] for line in lines] == [1, 2]


def test_the_reward_curve_is_titled_with_the_run_and_its_recipe(tiny_run):
    run_dir, _ = tiny_run
    assert Image.open(run_dir / "reward_curve.png").info["Title"] == f"{run_dir.name} (recipe arithmetic-tiny)"


def test_meshy_sample_answers_each_prompt_with_the_run_s_final_weights(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    # from a directory of its own: the run directory says where its task's module was imported from
    result = meshy("sample", str(run_dir), "3+4=", "1+1=", "3+4=", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    header, *answers = result.stdout.strip().split("\n\n")
    assert header == (f"meshy: {run_dir.name}: weights v2 ({run_dir / 'final_weights'}), greedy, at most 3 new tokens")
    pairs = [re.fullmatch(r"prompt: (.*)\ncompletion: ([0-9+*=-]{0,3})", a).groups() for a in answers]
    assert [p for p, _ in pairs] == ["3+4=", "1+1=", "3+4="]
    assert pairs[0][1] == pairs[2][1]  # greedy: the same prompt, the same answer
    earlier = meshy("sample", str(run_dir), "--version", "1", "--max-new-tokens", "2", "3+4=")
    assert earlier.returncode == 0, earlier.stderr
    assert f"weights v1 ({run_dir / 'weights' / 'v000001'}), greedy, at most 2 new tokens" in earlier.stdout


def test_meshy_sample_names_a_version_the_run_did_not_keep_and_lists_those_it_did(tiny_run):
    run_dir, _ = tiny_run
    result = meshy("sample", str(run_dir), "--version", "7", "3+4=")
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"meshy: --version 7: {run_dir} kept no weights of version 7; kept versions: 0, 1, 2"
    )


def test_meshy_sample_names_a_directory_that_is_not_a_run(tmp_path):
    result = meshy("sample", str(tmp_path), "3+4=")
    assert result.returncode == 2
    assert result.stderr == f"meshy: sample: {tmp_path} is not a run directory (no recipe.toml)\n"


@pytest.mark.parametrize(
    ("recipe", "options"),
    [("smollm2-135m-arithmetic-cpu", ReasoningGymOptions), ("qwen3-1.7b-grpo-gsm8k-1gpu", MathOptions)],
)
def test_a_sampled_question_is_asked_as_the_task_asks_its_own(recipe, options):
    loaded = load_recipe(shipped()[recipe])
    expected = options(**loaded.task.options).prompt("What is 2 + 3?")
    assert task_prompt(loaded, "What is 2 + 3?") == expected and "<|im_start|>user\n" in expected
    assert task_prompt(load_recipe(), "3+4=") == "3+4="  # the default's arithmetic has no template
