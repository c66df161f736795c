"""Fault injection: SIGKILL one process of a running pipeline, then `meshy run --resume` it.

Each case kills one role mid-run (after a checkpoint): the run must stop with a clear error within a
bounded time (no process left waiting), and the resumed run must finish with every version trained
once, no row trained twice and every row of every batch trained or counted as dropped.
"""

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshy.train import checkpoint
from tests.infer.test_sglang_engine import use_stub_kernels
from tests.recipes.test_agent_run import agent_recipe
from tests.recipes.test_pipeline import (
    FREE_BATCHES,
    GROUP,
    GROUPS,
    REPO,
    check_run,
    checkpointed,
    kept_rows,
    kill_tree,
    records,
    repo_env,
    small_recipe,
    start_time,
)

STEPS = 10
COMMAND = [sys.executable, "-m", "meshy.recipes.cli", "run"]
STOP_WITHIN_S = 90  # rpc timeouts and torchrun's teardown, with room for a loaded machine


def victim_pid(run_dir, target: str) -> int:
    """The pid of `target`: a role process ("inference-0", "training-1", ...) or "dataplane" (its controller)."""
    if target == "dataplane":
        (start,) = [r for r in records(run_dir, "training-0") if r["kind"] == "start"]
        return int(start["dataplane"]["controller"])
    (start,) = [r for r in records(run_dir, target) if r["kind"] == "start"]
    return int(start["pid"])


def wait_for_version(run, run_root, version: int, checkpoint: bool = False):
    """The run's directory once `version` versions are trained (and, with `checkpoint`, one checkpoint is
    complete)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and run.poll() is None:
        metrics = next(run_root.glob("*/metrics.jsonl"), None)
        trained = metrics is not None and len(metrics.read_text().splitlines()) >= version
        if trained and (not checkpoint or checkpointed(metrics.parent)):
            return metrics.parent
        time.sleep(0.05)
    raise AssertionError(f"the run should still be going at version {version}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "publish"),
    [
        ("rollout-0", "disk"),
        ("inference-0", "disk"),
        ("training-1", "disk"),
        ("dataplane", "disk"),
        ("inference-0", "collective"),  # the trainer's broadcast fails, not hangs
        ("training-0", "collective"),  # the publisher: engines waiting for a broadcast fail, not hang
    ],
)
def test_a_killed_process_stops_the_run_clearly_and_the_run_resumes_without_loss(tmp_path, target, publish):
    kept = "hf_every = 1\n" if publish == "collective" else ""  # resume drops and rewrites kept versions too
    recipe = small_recipe(tmp_path, "1", top=f'publish = "{publish}"\n{kept}', steps=STEPS)
    text = re.sub(r"^checkpoint_every = .*$", "checkpoint_every = 2", recipe.read_text(), flags=re.M)
    recipe.write_text(text.replace("[roles.training]\nprocesses = 1", "[roles.training]\nprocesses = 2"))
    run_dir, _ = kill_and_resume(tmp_path, recipe, target, torn_in="hf_versions" if kept else "weights")
    if kept:
        assert sorted(p.name for p in (run_dir / "hf_versions").iterdir()) == [f"v{v:06d}" for v in range(STEPS + 1)]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["training-0", "inference-0"])
def test_killing_a_member_of_a_training_and_inference_ring_loses_nothing_after_resume(tmp_path, target):
    """The 1-GPU recipes' shape: training and inference take turns with the devices through a token ring;
    one of them dies whoever holds the token at the time, and the resumed run's ring starts anew."""
    recipe = small_recipe(tmp_path, "1", top='colocate = [["training", "inference"]]\n', steps=STEPS)
    recipe.write_text(re.sub(r"^checkpoint_every = .*$", "checkpoint_every = 2", recipe.read_text(), flags=re.M))
    kill_and_resume(tmp_path, recipe, target, torn_in="weights")


@pytest.mark.sglang
@pytest.mark.parametrize("target", ["inference-0", "training-0"])
def test_killing_an_sglang_engine_or_the_publisher_of_its_broadcast_versions_stops_the_run_and_it_resumes_without_loss(
    tmp_path, target
):
    """Versions broadcast on SGLang's own weights update group (the 2-node recipe's path), with the default
    recipe's context_length, the whole of the tiny model's positions: an inference process killed takes
    its SGLang scheduler with it, so the trainer's next broadcast fails instead of waiting for a member
    that is gone; a publisher killed fails the scheduler's receive. Either way the run stops naming the
    resume command, and the resumed run (its engine joining a new group) loses nothing."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (uv sync --extra sglang)")
    use_stub_kernels()
    top = 'publish = "collective"\nhf_every = 1\n'
    recipe = small_recipe(tmp_path, "1", top=top, steps=STEPS)
    text = re.sub(r"^checkpoint_every = .*$", "checkpoint_every = 2", recipe.read_text(), flags=re.M)
    recipe.write_text(text.replace("[sampling]\n", '[sampling]\nengine = "sglang"\n'))
    run_dir, _ = kill_and_resume(tmp_path, recipe, target, torn_in="hf_versions")
    built = [r["engine"] for r in records(run_dir, "inference-0") if r["kind"] == "engine"]
    assert built == ["SGLangEngine"] * 2, built  # the first run's and the resumed one's


@pytest.mark.slow
@pytest.mark.parametrize("target", ["environment-0", "inference-0"])
def test_killing_a_process_of_a_multi_turn_run_mid_trajectory_loses_no_trajectory_after_resume(tmp_path, target):
    """The environment role (or the engine) dies with trajectories between turns; the resumed run trains
    every trajectory of every version once, and each is still token exact (the auditor's checks)."""
    recipe = agent_recipe(tmp_path, steps=STEPS, top="checkpoint_every = 2\n")
    run_dir, restored = kill_and_resume(tmp_path, recipe, target, torn_in="weights", max_staleness=1, enforced=True)
    audits = [r for r in records(run_dir, "auditor-0") if r["kind"] == "audit"]
    assert [a for a in audits if a["problems"]] == []
    played = [r for i in range(2) for r in records(run_dir, f"environment-{i}") if r["kind"] == "trajectory"]
    assert {t["row"] for t in played} >= set(range(restored * 16, STEPS * 16)), "every resumed row was played"


@pytest.mark.slow
@pytest.mark.parametrize("target", ["training-0", "dataplane"])
def test_a_resumed_run_trains_the_generated_rows_its_stopped_run_kept_on_disk(tmp_path, target):
    """Fully asynchronous pacing keeps batches generated ahead of training; killed after a checkpoint, the run
    keeps on disk those generated under the restored version or before and trains them after the resume,
    drops those generated later (saying why, in meshy inspect too), and removes its logs once finished."""
    recipe = small_recipe(tmp_path, '"none"', steps=STEPS)
    recipe.write_text(re.sub(r"^checkpoint_every = .*$", "checkpoint_every = 1", recipe.read_text(), flags=re.M))
    run_dir, restored = kill_and_resume(tmp_path, recipe, target, torn_in="weights", max_staleness=FREE_BATCHES + 2)
    kept = kept_rows(run_dir)
    assert kept is not None and kept["version"] == restored, kept
    assert kept["kept"]["rows"] > 0 and kept["kept"]["tokens"] > 0, kept
    later = f"generated under a version after v{restored}, which the resumed run discards"
    ahead = f"written ahead of what pacing allows at v{restored}: written again when due"
    # rows are acked once a checkpoint holds their version: the kill may land between the two
    checkpointed = f"trained into v{restored} or before, the version resumed from"
    assert set(kept["dropped"]) <= {later, ahead, checkpointed}, kept["dropped"]
    first = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][restored]
    assert first["version"] == restored + 1 and first["rows_trained"] > 0
    audit = subprocess.run(
        [*COMMAND[:-1], "inspect", str(run_dir)], env=repo_env(), capture_output=True, text=True, timeout=120
    )
    assert f"resumed at v{restored} with rows kept on disk:" in audit.stdout, audit.stdout
    assert f"{kept['kept']['rows']} rows, {kept['kept']['tokens']} tokens" in audit.stdout
    assert not (run_dir / "dataplane").exists(), "a finished run's logs are removed"


def kill_and_resume(
    tmp_path: Path,
    recipe: Path,
    target: str,
    torn_in: str,
    max_staleness: int = 0,
    enforced: bool = False,
) -> tuple[Path, int]:
    """Run `recipe`, SIGKILL `target` after version 3, check the run stops naming the resume command,
    resume it (with a torn version directory planted in `torn_in`, as a kill mid-write leaves), and
    check the ledger of the resumed run; the run directory and the version it resumed at."""
    env = repo_env()
    first = subprocess.Popen(
        [*COMMAND, str(recipe)],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        run_dir = wait_for_version(first, tmp_path, 3, checkpoint=True)
        os.kill(victim_pid(run_dir, target), signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = first.communicate(timeout=STOP_WITHIN_S)
        stopped_after = time.monotonic() - killed_at
    finally:
        kill_tree(first)
        first.wait()
    assert first.returncode != 0, f"killing {target} must not look like success"
    assert "meshy: continue from its newest checkpoint, step-" in stderr, stderr[-3000:]
    assert f"with: meshy run --resume {run_dir}" in stderr
    if target != "dataplane":
        assert f"({target} on node 0) failed first: killed by SIGKILL" in stderr, stderr[-3000:]
    assert stopped_after < STOP_WITHIN_S
    restored = max(int(p.name.removeprefix("step-")) for p in (run_dir / "checkpoints").glob("step-*"))
    torn = run_dir / torn_in / f".v{restored + 1:06d}.tmp1"
    torn.mkdir(parents=True, exist_ok=True)
    resumed = subprocess.run([*COMMAND, "--resume", str(run_dir)], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    check_run(run_dir, max_staleness, resumed_at=restored, steps=STEPS, enforced=enforced)
    assert not torn.exists()
    return run_dir, restored


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            child, rest = stat.read_text().split(" ", 1)
            if int(rest.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(child))
    return found


def run_processes(run_dir) -> list[int]:
    """Every process of a one-rank-per-role run: the role processes and the data-plane servers."""
    pids = [victim_pid(run_dir, name) for name in ("training-0", "inference-0", "rollout-0")]
    (start,) = [r for r in records(run_dir, "training-0") if r["kind"] == "start"]
    servers = start["dataplane"]
    return [*pids, servers["launcher"], servers["controller"], *servers["storage"]]


def left_running(started: dict[int, str | None], within_s: float = 30) -> list[int]:
    """The processes of `started` (pid: start time) still running after waiting up to `within_s` for them
    to go (a pid reused by a new process does not count)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(start_time(pid) == at for pid, at in started.items()):
        time.sleep(0.1)
    return [pid for pid, at in started.items() if start_time(pid) == at]


def kill_left(started: dict[int, str | None]) -> None:
    for pid in left_running(started, within_s=0):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_meshy_run_stops_every_process_of_the_run(tmp_path, signum):
    """SIGTERM (a scheduler, `timeout`, `kill`) to meshy run alone: it stops torchrun and its ranks and
    says how to resume. SIGKILL: nothing is said, and nothing is left running."""
    recipe = small_recipe(tmp_path, "1", steps=1_000_000)  # a run that cannot end by itself meanwhile
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    meshy = subprocess.Popen(
        [*COMMAND, str(recipe)],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    started: dict[int, str | None] = {}
    try:
        run_dir = wait_for_version(meshy, tmp_path, 1)
        started = {pid: start_time(pid) for pid in [*children(meshy.pid), *run_processes(run_dir)]}
        assert None not in started.values() and len(started) == 7, started  # torchrun, 3 ranks, 3 servers
        os.kill(meshy.pid, signum)
        _, stderr = meshy.communicate(timeout=60)
        alive = left_running(started)
        assert not alive, f"processes left running after meshy run was sent {signum.name}: {alive}"
        if signum == signal.SIGTERM:
            assert meshy.returncode not in (0, -signal.SIGTERM), stderr[-2000:]
            assert "meshy: meshy run was sent SIGTERM and stopped torchrun and its ranks" in stderr, stderr[-2000:]
            assert f"meshy run --resume {run_dir}" in stderr
    finally:
        kill_tree(meshy)
        kill_left(started)  # a failed run leaves orphans no longer under meshy: kill them by pid
        meshy.wait()


def test_killing_torchrun_takes_every_process_of_the_run_with_it(tmp_path):
    recipe = small_recipe(tmp_path, "1", steps=1_000_000)  # a run that cannot end by itself meanwhile
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    meshy = subprocess.Popen([*COMMAND, str(recipe)], env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    started: dict[int, str | None] = {}
    try:
        run_dir = wait_for_version(meshy, tmp_path, 1)
        (agent,) = children(meshy.pid)
        started = {pid: start_time(pid) for pid in run_processes(run_dir)}
        assert None not in started.values(), started
        os.kill(agent, signal.SIGKILL)
        alive = left_running(started)
        assert not alive, f"processes left running after torchrun was killed: {alive}"
    finally:
        kill_tree(meshy)
        kill_left(started)  # a failed run leaves orphans no longer under meshy: kill them by pid
        meshy.wait()


@pytest.mark.slow
def test_rows_trained_after_the_newest_checkpoint_are_trained_again_after_a_resume_not_generated_again(tmp_path):
    """Rows kept on disk are acked only once a checkpoint holds the version that trained them: a trainer killed
    a version or two past its newest checkpoint leaves them in the data plane, and the resumed run trains the
    very same rows again for that version instead of generating new ones (none of its tokens regenerated)."""
    every = 5
    recipe = small_recipe(tmp_path, "1", steps=STEPS)
    recipe.write_text(re.sub(r"^checkpoint_every = .*$", f"checkpoint_every = {every}", recipe.read_text(), flags=re.M))
    run = subprocess.Popen([*COMMAND, str(recipe)], env=repo_env(), start_new_session=True, stderr=subprocess.PIPE)
    try:
        run_dir = wait_for_version(run, tmp_path, every, checkpoint=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # a version or two past the newest checkpoint, well before the next
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            newest = checkpoint.latest(run_dir / "checkpoints")
            if newest is not None and 1 <= len(lines) - checkpoint.step_of(newest) <= 2:
                break
            time.sleep(0.002)
        os.kill(victim_pid(run_dir, "training-0"), signal.SIGKILL)
        run.communicate(timeout=STOP_WITHIN_S)
    finally:
        kill_tree(run)
        run.wait()
    restored = checkpoint.step_of(checkpoint.latest(run_dir / "checkpoints"))
    stopped = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(stopped) > restored, "killed past its newest checkpoint"
    resumed = subprocess.run([*COMMAND, "--resume", str(run_dir)], env=repo_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    check_run(run_dir, 0, resumed_at=restored, steps=STEPS)
    kept = kept_rows(run_dir)
    assert kept is not None and kept["retrained"]["rows"] == GROUPS * GROUP, kept  # the first discarded version's
    assert not any("trained after the checkpoint" in reason for reason in kept["dropped"]), kept["dropped"]
    audit = subprocess.run(
        [*COMMAND[:-1], "inspect", str(run_dir)], env=repo_env(), capture_output=True, text=True, timeout=120
    )
    assert f"{GROUPS * GROUP} rows, {kept['retrained']['tokens']} tokens" in audit.stdout, audit.stdout
    assert "of them trained again: a version after the checkpoint had trained them" in audit.stdout
    after = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    retrained = after[restored]
    assert retrained["version"] == restored + 1
    assert retrained["row_ids"] == stopped[restored]["row_ids"], "the same rows trained again, none regenerated"
