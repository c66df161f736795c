"""A run that survives a lost process: inference (or rollout, environment, teacher, reference) with max_restarts,
SIGKILLed mid-run, started again in place.

The run goes on without a resume; the rows the killed engine held come back when their short leases run
out and are generated again; the ledger of the finished run holds every version once and every row once.
A kill past max_restarts stops the run as any death does, and it resumes.
"""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from meshy.dataplane.journal import JOURNAL_FILE
from meshy.dataplane.record_log import read
from meshy.recipes.observe.inspect_run import report
from meshy.recipes.recipe.dataflow import PARTIALS
from tests.recipes.test_agent_run import agent_recipe
from tests.recipes.test_faults import COMMAND, STOP_WITHIN_S, wait_for_version
from tests.recipes.test_pipeline import (
    GROUP,
    GROUPS,
    check_run,
    kill_tree,
    records,
    repo_env,
    sharp_teacher,
    small_recipe,
)

STEPS = 10


def engine_process(run_dir, attempt: int, process: str = "inference-0") -> int:
    """The pid of `process`'s child process of `attempt` (0: the first), once it has started."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        started = [r for r in records(run_dir, process) if r["kind"] == "start" and r.get("attempt") == attempt]
        if started:
            return int(started[-1]["pid"])
        time.sleep(0.1)
    raise AssertionError(f"{process}'s child of attempt {attempt} did not start")


def metrics_lines(run_dir) -> int:
    return len((run_dir / "metrics.jsonl").read_text().splitlines())


@pytest.mark.slow
def test_a_killed_engine_restarts_in_place_and_the_run_loses_nothing_then_a_kill_past_max_restarts_stops_it(
    tmp_path,
):
    recipe = small_recipe(tmp_path, "1", steps=STEPS)
    text = recipe.read_text().replace("checkpoint_every = 100", "checkpoint_every = 2")
    recipe.write_text(text.replace("[roles.inference]\n", "[roles.inference]\nmax_restarts = 1\n"))
    run = subprocess.Popen(
        [*COMMAND, str(recipe)], env=repo_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        run_dir = wait_for_version(run, tmp_path, 3)
        first = engine_process(run_dir, 0)
        os.kill(first, signal.SIGKILL)
        killed_at = metrics_lines(run_dir)
        engine_process(run_dir, 1)
        wait_for_version(run, tmp_path, killed_at + 3)  # the run went on
        os.kill(engine_process(run_dir, 1), signal.SIGKILL)  # past max_restarts = 1
        _, stderr = run.communicate(timeout=STOP_WITHIN_S)
    finally:
        kill_tree(run)
        run.wait()
    stderr = stderr.decode()
    assert f"inference process 0 (pid {first}) was killed by SIGKILL; starting it again (restart 1 of 1)" in stderr
    assert "inference process 0 was killed by SIGKILL, past its max_restarts = 1" in stderr, stderr[-3000:]
    assert run.returncode != 0 and f"meshy run --resume {run_dir}" in stderr
    (restart,) = [r for r in records(run_dir, "inference-0") if r["kind"] == "restart"]
    assert restart["pid"] == first and restart["signal"] == "SIGKILL" and restart["restart"] == 1
    survived = metrics_lines(run_dir)
    assert survived >= killed_at + 3

    resumed = subprocess.run(
        [*COMMAND, "--resume", str(run_dir)], env=repo_env(), capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    restored = max(int(p.name.removeprefix("step-")) for p in (run_dir / "checkpoints").glob("step-*"))
    check_run(run_dir, 0, resumed_at=restored, steps=STEPS)
    given_back = restart["released"]
    assert f"inference-0: restarted 1 of 1 times in place (1 x SIGKILL), {given_back} leased rows" in report(run_dir)


def scoring_recipe(tmp_path, role: str):
    """The default recipe scored by a reference policy (KL) or distilled from a teacher, that role in a process
    of its own that restarts in place once."""
    section = f"\n[roles.{role}]\nprocesses = 1\nmax_restarts = 1\n"
    recipe = small_recipe(tmp_path, "1", tail=section, steps=STEPS)
    text = recipe.read_text()
    if role == "reference":
        text = text.replace("[algorithm.loss]\n", "[algorithm.loss]\nkl_coef = 0.1\n")
    else:
        text = text.replace('kind = "grpo"', 'kind = "distill"').replace(
            'tis = "none"', 'tis = "none"\npg_coef = 0.0\ndistill_coef = 1.0'
        )
        text = text.replace("[model]\n", f'[model]\nteacher = "{sharp_teacher(tmp_path / "teacher")}"\n')
    recipe.write_text(text)
    return recipe


@pytest.mark.slow
@pytest.mark.parametrize("role", ["reference", "teacher"])
def test_a_killed_reference_or_teacher_restarts_in_place_and_the_run_finishes_by_itself(tmp_path, role):
    """The scoring roles hold nothing of the run's progress: killed mid-run, started again in place, they
    score the rows their predecessor held, and the run ends on its own with every row scored once."""
    process = f"{role}-0"
    run_dir, first, stderr = run_killing(scoring_recipe(tmp_path, role), tmp_path, process)
    assert f"{role} process 0 (pid {first}) was killed by SIGKILL; starting it again" in stderr
    metrics = check_run(run_dir, 0, steps=STEPS)
    assert all(m["rows_trained"] == GROUPS * GROUP and not m["dropped"] for m in metrics), "every row was scored"
    (restart,) = [r for r in records(run_dir, process) if r["kind"] == "restart"]
    assert restart["pid"] == first and f"{process}: restarted 1 of 1 times in place" in report(run_dir)


def first_chunk_after(journal: Path, seen: int, within_s: float = 120) -> None:
    """Returns once the data plane's journal records a chunk of a response in progress after its first `seen`
    records: the engine is in the middle of a response."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if any(r[0] == "commit" and r[1] == PARTIALS for r in read(journal).records[seen:]):
            return
        time.sleep(0.005)
    raise AssertionError("no chunk of a response in progress was written")


@pytest.mark.slow
def test_a_restarted_engine_continues_the_responses_its_predecessor_kept_in_chunks(tmp_path):
    """sampling.keep_partial_every: the engine killed in the middle of responses (right after one of them
    wrote a chunk), the engine started again in place continues them from their chunks."""
    recipe = small_recipe(tmp_path, "1", steps=STEPS)
    text = recipe.read_text().replace("[roles.inference]\n", "[roles.inference]\nmax_restarts = 1\n")
    recipe.write_text(re.sub(r"^max_new_tokens = .*$", "max_new_tokens = 64\nkeep_partial_every = 4", text, flags=re.M))
    run = subprocess.Popen(
        [*COMMAND, str(recipe)], env=repo_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        run_dir = wait_for_version(run, tmp_path, 3)
        first = engine_process(run_dir, 0)
        journal = run_dir / "dataplane" / "node0" / JOURNAL_FILE
        first_chunk_after(journal, len(read(journal).records))
        os.kill(first, signal.SIGKILL)
        engine_process(run_dir, 1)
        _, stderr = run.communicate(timeout=300)
    finally:
        kill_tree(run)
        run.wait()
    assert run.returncode == 0, stderr.decode()[-5000:]
    check_run(run_dir, 0, resumed_at=STEPS, steps=STEPS)  # the killed engine's rows are in no record of its own
    final = [r for r in records(run_dir, "inference-0") if r["kind"] == "inference"][-1]
    assert final["resumed_rows"] > 0 and final["resumed_tokens"] >= 4, final


def run_killing(recipe: Path, tmp_path: Path, process: str) -> tuple[Path, int, str]:
    """Run `recipe`, SIGKILL `process`'s child after version 3 and let the run finish by itself: the run
    directory, the killed pid and the run's stderr."""
    run = subprocess.Popen(
        [*COMMAND, str(recipe)], env=repo_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        run_dir = wait_for_version(run, tmp_path, 3)
        first = engine_process(run_dir, 0, process)
        os.kill(first, signal.SIGKILL)
        engine_process(run_dir, 1, process)
        _, stderr = run.communicate(timeout=300)
    finally:
        kill_tree(run)
        run.wait()
    assert run.returncode == 0, stderr.decode()[-5000:]
    assert f"process {process.rsplit('-', 1)[1]} (pid {first}) was killed by SIGKILL; starting it again" in (
        stderr.decode()
    )
    return run_dir, first, stderr.decode()


@pytest.mark.slow
def test_a_killed_rollout_restarts_in_place_and_writes_no_batch_its_predecessor_wrote(tmp_path):
    """Pacing 2: the rollout process had written a batch ahead of training when it died; the one started again
    in place skips every row its predecessor wrote (trained and retired, or still in the data plane), writes
    the rest, and scores and computes the advantages of the rows left half done."""
    recipe = small_recipe(tmp_path, "2", steps=STEPS)
    recipe.write_text(recipe.read_text().replace("[roles.rollout]\n", "[roles.rollout]\nmax_restarts = 1\n"))
    run_dir, first, _ = run_killing(recipe, tmp_path, "rollout-0")
    check_run(run_dir, 1, steps=STEPS)
    found = records(run_dir, "rollout-0")
    (restart,) = [r for r in found if r["kind"] == "restart"]
    assert restart["pid"] == first
    before = [r["batch"] for r in found if r["kind"] == "batch" and r["time"] < restart["time"]]
    after = [r["batch"] for r in found if r["kind"] == "batch" and r["time"] > restart["time"]]
    assert before and after and not set(before) & set(after), (before, after)
    assert sorted(before + after) == list(range(len(before) + len(after))), "every batch written once, in order"


@pytest.mark.slow
def test_a_killed_environment_restarts_in_place_and_its_trajectories_are_played_on_token_exact(tmp_path):
    """Multi-turn: an environment process dies with trajectories between turns; the one started again in place
    (or its sibling) takes the turns its predecessor held, and every trajectory reaches training once and
    token exact (the auditor's checks)."""
    recipe = agent_recipe(tmp_path, steps=STEPS)
    recipe.write_text(recipe.read_text().replace("[roles.environment]\n", "[roles.environment]\nmax_restarts = 1\n"))
    run_dir, first, _ = run_killing(recipe, tmp_path, "environment-0")
    check_run(run_dir, 1, steps=STEPS, enforced=True)
    audits = [r for r in records(run_dir, "auditor-0") if r["kind"] == "audit"]
    assert audits and [a for a in audits if a["problems"]] == []
    (restart,) = [r for r in records(run_dir, "environment-0") if r["kind"] == "restart"]
    assert restart["pid"] == first
