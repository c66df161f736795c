"""End-to-end runs of the whole pipeline on CPU with `meshy run` (real torchrun, real processes)."""

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshy.dataplane.hf_directory import HFDirectory
from meshy.dataplane.model_source import read_model
from meshy.recipes.recipe import DEFAULT_RECIPE, load_recipe
from meshy.recipes.roles.rollout import FREE_BATCHES
from meshy.train import checkpoint
from meshy.train.parallel import build_model
from meshy.train.publish import DirectoryPublisher, hf_tensors
from meshy.train.training_config import ParallelConfig

REPO = Path(__file__).resolve().parents[2]
STEPS, GROUPS, GROUP = 4, 4, 4


def small_recipe(tmp_path: Path, pacing: str, top: str = "", tail: str = "", steps: int = STEPS) -> Path:
    """The embedded default, shrunk to a few steps of a few groups, writing under tmp_path."""
    text = DEFAULT_RECIPE.read_text()
    for key, value in (
        ("steps", steps),
        ("group_size", GROUP),
        ("prompts_per_step", GROUPS),
        ("pacing", pacing),
        ("max_in_flight", 64),
        ("run_dir", f'"{tmp_path}"'),
    ):
        text, count = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
        assert count == 1, key
    path = tmp_path / "recipe.toml"
    path.write_text(top + text + tail)
    return path


def repo_env() -> dict[str, str]:
    """This environment, with the repository first on PYTHONPATH (the tests' own modules import in a run's
    processes; what was on it stays, such as the SGLang tier's kernel stand-in)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}


def meshy_run(recipe: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`meshy run RECIPE` in a child process that can import the tests' own modules (custom roles)."""
    return subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "run", str(recipe)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=repo_env(),
    )


def run(recipe: Path) -> Path:
    result = meshy_run(recipe)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (run_dir,) = [p for p in recipe.parent.iterdir() if p.is_dir()]
    assert f"run directory: {run_dir.resolve()}" in result.stdout
    return run_dir


def checkpointed(run_dir: Path | None) -> bool:
    """Whether the run has a complete checkpoint: one written in the background (the default) is complete,
    renamed into place, only after the versions that follow it may have trained."""
    return run_dir is not None and checkpoint.latest(run_dir / "checkpoints") is not None


def records(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "records" / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_run(
    run_dir: Path,
    max_staleness: int,
    resumed_at: int = 0,
    steps: int = STEPS,
    architecture: str = "Qwen3ForCausalLM",
    enforced: bool = False,
) -> list[dict]:
    """The run's ledger: every version trained once, every row trained or dropped once, no token trained
    more than `max_staleness` versions behind. enforced: the recipe sets algorithm.max_staleness to it, so
    older tokens may arrive (they count in the histogram) and must be masked out, not trained."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == list(range(1, steps + 1)), "versions strictly increase"
    trained = [r for m in metrics for r in m["row_ids"]]
    dropped = [d["row"] for m in metrics for d in m["dropped"]]
    assert len(trained) + len(dropped) == steps * GROUPS * GROUP
    assert len(set(trained + dropped)) == len(trained) + len(dropped), "no row trained twice"
    assert len(trained) == sum(m["rows_trained"] for m in metrics)
    engines = sorted(path.stem for path in (run_dir / "records").glob("inference-*.jsonl"))
    generated = sum(records(run_dir, engine)[-1]["rows"] for engine in engines)  # by the last (resumed) run
    since = [m for m in metrics if m["version"] > resumed_at]
    assert sum(m["rows_trained"] + m["rows_dropped"] for m in since) <= generated
    for m in metrics:  # a version whose rows were all dropped (dynamic sampling) trained no token
        assert bool(m["staleness_histogram"]) == bool(m["rows_trained"]), m
        ages = {int(k.lstrip(">=")): n for k, n in m["staleness_histogram"].items()}
        if enforced:
            assert sum(n for age, n in ages.items() if age <= max_staleness) == m["tokens"], m
        else:
            assert max(ages, default=0) <= max_staleness, m
    for engine in engines:
        loaded = records(run_dir, engine)[-1]["versions"]
        assert loaded == sorted(set(loaded)), "inference loaded versions in order, each once"
    final = run_dir / "final_weights"
    if (final / "adapter_config.json").is_file():  # a LoRA run's: a PEFT adapter on the base it names
        base = Path(json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"])
        assert (final / "adapter_model.safetensors").is_file() and base.is_dir(), base
        final = base
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == [architecture] and (final / "model.safetensors").is_file()
    assert (run_dir / "reward_curve.png").is_file() and (run_dir / "tensorboard").is_dir()
    return metrics


@pytest.mark.parametrize(("pacing", "max_staleness"), [("1", 0), ("2", 1), ('"none"', FREE_BATCHES)])
def test_pacing_modes_train_every_generated_row_once_within_the_staleness_bound(tmp_path, pacing, max_staleness):
    check_run(run(small_recipe(tmp_path, pacing)), max_staleness)


def test_a_mixture_of_experts_trains_every_version_replaying_the_engine_s_routing(tmp_path):
    """Bounded off-policy (pacing 2), so rows are sampled by a version older than the one training them:
    the trainer replays, for every response token of every row, the experts the engine chose. Training
    runs as the Qwen3-30B-A3B recipes do, in miniature: two processes, experts split between them (ep 2)."""
    recipe = small_recipe(tmp_path, "2")
    text = recipe.read_text().replace('name = "qwen3-tiny"', 'name = "qwen3-tiny-moe"')
    text = text.replace("[roles.training]\nprocesses = 1", "[roles.training]\nprocesses = 2")
    text += "\n[algorithm.parallel]\nep = 2\n"
    recipe.write_text(re.sub(r"^pacing = 2$", "pacing = 2\nrouting_replay = true", text, flags=re.M))
    metrics = check_run(run(recipe), 1, architecture="Qwen3MoeForCausalLM")
    for m in metrics:
        assert m["rows_trained"] == GROUPS * GROUP and m["rows_dropped"] == 0, m
        assert m["replayed_tokens"] == m["tokens"] > 0, "every trained token was routed as the engine routed it"
    assert any(int(age) > 0 for m in metrics for age in m["staleness_histogram"]), "some rows were off-policy"


def test_colocated_training_and_inference_pass_the_token_and_stay_on_policy(tmp_path):
    """Two rings: training's two processes (FSDP) each share their devices with one inference process."""
    recipe = small_recipe(tmp_path, "1", top='colocate = [["training", "inference"]]\n')
    for role in ("training", "inference"):
        text = recipe.read_text()
        recipe.write_text(text.replace(f"[roles.{role}]\nprocesses = 1", f"[roles.{role}]\nprocesses = 2"))
    run_dir = run(recipe)
    check_run(run_dir, 0)
    for index in (0, 1):
        names = (f"training-{index}", f"inference-{index}")
        grants = [r for name in names for r in records(run_dir, name) if r["kind"] == "grant"]
        turns = check_turns(run_dir, ["training", "inference"], index)
        # the trainer held the devices to build, to publish version 0, and for each step
        assert sum(g["holder"] == "training" for g in grants) == len(turns["training"]) == STEPS + 2
        assert [t["what"] for t in turns["inference"]] == ["build"], "inference holds the devices by default"
        assert all(g["payload"]["version"] >= 1 for g in grants if g["holder"] == "inference" and g["payload"])
    audit = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "inspect", str(run_dir)], capture_output=True, text=True, timeout=60
    )
    assert audit.returncode == 0, audit.stderr
    lines = audit.stdout.splitlines()
    assert (
        f"weights versions trained and published: {STEPS} (v1..v{STEPS})  gaps []  duplicates []  reordered []" in lines
    )
    assert re.search(
        r"^staleness of policy tokens as they reached training \(versions behind; [^)]*\): 0: \d+ \(100\.0%\)$",
        audit.stdout,
        re.M,
    )
    assert f"rows trained {STEPS * GROUPS * GROUP}, dropped 0" in lines


def check_turns(run_dir: Path, ring: list[str], index: int = 0) -> dict[str, list[dict]]:
    """The ring's grants are numbered 1, 2, ... each taken once; every turn of a member ran under a grant
    made to it, the first of them its build (inference's engine, an ON_DEMAND member's model), and `meshy
    inspect` finds no two turns that overlapped in time. Each member's turns, by name (ring `index`: the
    index-th process of each role)."""
    grants = [r for role in ring for r in records(run_dir, f"{role}-{index}") if r["kind"] == "grant"]
    assert sorted(g["seq"] for g in grants) == list(range(1, len(grants) + 1)), "grants are contiguous, each taken once"
    holders = {g["seq"]: g["holder"] for g in grants}
    turns = {role: [r for r in records(run_dir, f"{role}-{index}") if r["kind"] == "device_turn"] for role in ring}
    for role, taken in turns.items():
        assert all(holders[t["seq"]] == role for t in taken), f"{role} computed only under its own grants"
        first = min(taken, key=lambda t: t["start"])
        assert [t["what"] for t in taken].count("build") == 1 and first["what"] == "build", (
            f"{role} built its state on the devices in a turn of its own, before any other turn"
        )
    audit = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "inspect", str(run_dir)], capture_output=True, text=True, timeout=60
    )
    assert audit.returncode == 0, audit.stderr
    line = next(line for line in audit.stdout.splitlines() if line.startswith(f"ring {'+'.join(ring)}-{index}: "))
    assert line.endswith(f"  turns {sum(map(len, turns.values()))}, overlapping 0"), line
    return turns


def test_a_custom_role_from_a_test_module_writes_its_own_column(tmp_path):
    extra = (
        '\n[[roles.custom]]\nname = "scorer"\ncls = "tests.recipes.custom_role:LengthScorer"\n'
        'options = { column = "rm_score" }\ntask = "length_scorer"\nreads = ["response_ids"]\nwrites = ["rm_score"]\n'
    )
    columns = '\n[[extra_columns]]\nname = "rm_score"\ndtype = "float32"\n'
    run_dir = run(small_recipe(tmp_path, "1", top="", tail=extra + columns))
    check_run(run_dir, 0)
    assert records(run_dir, "scorer-0")[-1]["rows"] >= STEPS * GROUPS * GROUP, "rows wait for the scorer's ack"


def test_ppo_with_a_critic_values_every_row_and_trains_the_critic_taking_turns_in_a_ring(tmp_path):
    """The critic, and the reference the KL term needs, share the devices with training and inference:
    each ON_DEMAND member computes only in turns of its own (the critic's path without a ring runs in the
    multi-turn PPO test)."""
    ring = ["training", "inference", "critic", "reference"]
    recipe = small_recipe(
        tmp_path,
        "1",
        top=f"colocate = [{ring}]\n".replace("'", '"'),
        tail="\n[roles.critic]\nprocesses = 1\n\n[roles.reference]\nprocesses = 1\n",
    )
    text = recipe.read_text().replace('kind = "grpo"', 'kind = "ppo"')
    recipe.write_text(text.replace("[algorithm.loss]\n", "[algorithm.loss]\nkl_coef = 0.1\n"))
    run_dir = run(recipe)
    metrics = check_run(run_dir, 0)
    assert all(m["rows_trained"] == GROUPS * GROUP and not m["dropped"] for m in metrics), (
        "every row got values, returns, advantages and ref_logprobs"
    )
    critic = records(run_dir, "critic-0")
    assert critic[-1]["valued"] >= STEPS * GROUPS * GROUP
    steps = [r for r in critic if r["kind"] == "critic_step"]
    assert len(steps) >= STEPS - 1 and all(torch.isfinite(torch.tensor(r["value_loss"])) for r in steps)
    assert records(run_dir, "reference-0")[-1]["rows"] >= STEPS * GROUPS * GROUP
    turns = check_turns(run_dir, ring)
    assert [t["what"] for t in turns["training"]].count("compute") == STEPS + 1, "version 0, then each step"
    assert turns["critic"] and turns["reference"], "the critic and the reference computed in turns of their own"


def test_dynamic_sampling_skips_whole_uniform_groups_and_counts_them_as_dropped(tmp_path):
    text = small_recipe(tmp_path, "1").read_text()
    text = text.replace('kind = "grpo"', 'kind = "grpo"\ndynamic_sampling = true\noverlong_buffer = 1')
    (tmp_path / "recipe.toml").write_text(text)
    metrics = check_run(run(tmp_path / "recipe.toml"), 0)
    dropped = [d for m in metrics for d in m["dropped"]]
    assert dropped, "a tiny model from scratch has uniform groups"
    assert {d["reason"] for d in dropped} == {
        "no advantage: rollout skipped it (dynamic sampling: its group's rewards are all equal)"
    }
    groups = {}
    for d in dropped:
        groups.setdefault(d["row"] // GROUP, set()).add(d["row"])
    assert all(len(rows) == GROUP for rows in groups.values()), "whole groups are skipped"
    assert sum(m["rows_trained"] for m in metrics) > 0


def test_tied_group_penalty_pushes_down_the_groups_tied_below_the_batch_s_best(tmp_path):
    recipe = small_recipe(tmp_path, "1")
    text = recipe.read_text().replace('kind = "grpo"', 'kind = "grpo"\ntied_group_penalty = 0.5')
    text = text.replace(
        'reward = "meshy.recipes.tasks.arithmetic:exact_match"',
        'reward = "tests.recipes.parity_reward:answer_parity_reward"',  # every group tied, at 0 or at 1
    )
    recipe.write_text(text)
    run_dir = run(recipe)
    metrics = check_run(run_dir, 0)
    scored = [r for r in records(run_dir, "rollout-0") if r["kind"] == "advantage"]
    assert sum(r["groups"] for r in scored) >= STEPS * GROUPS  # and what was played past the last version
    for r in scored:  # the groups at 0 are pushed, unless no group of the batch scored 1
        solved = round(r["reward_mean"] * r["groups"])
        assert r["tied_below_best"] == (r["groups"] - solved if solved else 0), r
    assert any(r["tied_below_best"] for r in scored), "some batch had both kinds of group"
    # GRPO alone gives every row advantage 0 here; pushed down, a token's clipped loss is 0.5 * its ratio > 0
    assert all(m["pg_loss"] >= 0 for m in metrics) and any(m["pg_loss"] > 0 for m in metrics)


def sharp_teacher(root: Path) -> Path:
    """A Qwen3 teacher with the student's architecture and a peaked output distribution (a scaled final
    norm), so the student starts far from it."""
    arch = load_recipe(DEFAULT_RECIPE).model.arch()
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=123)
    with torch.no_grad():
        model.norm.weight.mul_(20.0)
    return Path(DirectoryPublisher(root, arch, dtype="float32").publish(model, 0).location)


def test_online_distillation_pulls_the_student_towards_the_teacher(tmp_path):
    teacher = sharp_teacher(tmp_path / "teacher")
    (tmp_path / "run").mkdir()
    ring = ["training", "inference", "teacher"]  # the teacher scores in turns on the devices
    text = small_recipe(
        tmp_path / "run", "1", top=f"colocate = [{ring}]\n".replace("'", '"'), tail="\n[roles.teacher]\nprocesses = 1\n"
    ).read_text()
    text = text.replace('kind = "grpo"', 'kind = "distill"').replace(
        'tis = "none"', 'tis = "none"\npg_coef = 0.0\ndistill_coef = 1.0'
    )
    text = text.replace("[model]\n", f'[model]\nteacher = "{teacher}"\n')
    (tmp_path / "run" / "recipe.toml").write_text(text)
    run_dir = run(tmp_path / "run" / "recipe.toml")
    metrics = check_run(run_dir, 0)
    kl = [m["distill_kl"] for m in metrics]
    assert kl[-1] < 0.9 * kl[0], kl
    assert records(run_dir, "teacher-0")[-1]["rows"] >= STEPS * GROUPS * GROUP
    assert check_turns(run_dir, ring)["teacher"], "the teacher scored in turns of its own"


def test_kl_to_the_reference_policy_starts_at_zero_and_grows_as_the_policy_moves(tmp_path):
    recipe = small_recipe(tmp_path, "1", tail="\n[roles.reference]\nprocesses = 1\n")
    recipe.write_text(recipe.read_text().replace("[algorithm.loss]\n", "[algorithm.loss]\nkl_coef = 0.1\n"))
    run_dir = run(recipe)
    metrics = check_run(run_dir, 0)
    assert all(m["rows_trained"] == GROUPS * GROUP and not m["dropped"] for m in metrics), "every row had ref_logprobs"
    scored = records(run_dir, "reference-0")[-1]
    assert scored["rows"] >= STEPS * GROUPS * GROUP and scored["unscored"] == 0 and scored["version"] == 0
    assert scored["device"] == "cpu"
    kl = [m["kl"] for m in metrics]
    assert all(math.isfinite(k) for k in kl), kl
    assert abs(kl[0]) < 1e-9, f"version 1 trains the reference's own weights: no KL to it, got {kl}"
    assert all(k > 1e-6 for k in kl[1:]), f"each update moves the policy away from the reference: {kl}"
    loaded = load_recipe(recipe)
    scratch, _ = build_model(loaded.model.arch(), ParallelConfig(), device="cpu", seed=loaded.seed)
    _, reference = read_model(run_dir / "reference" / "v000000")
    expected = dict(hf_tensors(scratch, loaded.model.arch(), torch.float32))
    assert reference.keys() == expected.keys() and all(torch.equal(reference[k], v) for k, v in expected.items())


def kill_tree(root: subprocess.Popen) -> None:
    """SIGKILL a child process and all its descendants (torchrun starts its workers in sessions of their
    own). Only while the child is unreaped: once reaped, its pid may already be an unrelated process's;
    a descendant is killed only if it is still the process that was found (same start time)."""
    if root.poll() is not None:
        return
    children: dict[int, list[tuple[int, str]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" ", 1)
        except OSError:
            continue
        fields = rest.rsplit(")", 1)[1].split()
        children.setdefault(int(fields[1]), []).append((int(pid), fields[19]))
    tree, i = [(root.pid, None)], 0
    while i < len(tree):
        tree += children.get(tree[i][0], [])
        i += 1
    for pid, started in tree:
        if started is None or start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def start_time(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot), or None once it has exited (a zombie has exited too:
    only its parent has yet to reap it, and an orphan's reaper may never do so in a container)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def test_a_killed_run_resumes_from_its_last_checkpoint_and_finishes_every_version_once(tmp_path):
    steps = 12
    recipe = small_recipe(tmp_path, "1", steps=steps)
    recipe.write_text(re.sub(r"^checkpoint_every = .*$", "checkpoint_every = 2", recipe.read_text(), flags=re.M))
    command = [sys.executable, "-m", "meshy.recipes.cli", "run"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    crashed = subprocess.Popen([*command, str(recipe)], env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        metrics = None
        while time.monotonic() < deadline and crashed.poll() is None:
            metrics = next(tmp_path.glob("*/metrics.jsonl"), None)
            if metrics is not None and len(metrics.read_text().splitlines()) >= 3 and checkpointed(metrics.parent):
                break
            time.sleep(0.05)
        assert metrics is not None and crashed.poll() is None, "the run should still be going at version 3"
    finally:
        kill_tree(crashed)  # every process of the run at once, as a machine failure would
        crashed.wait()
    run_dir = metrics.parent
    restored = max(int(p.name.removeprefix("step-")) for p in (run_dir / "checkpoints").glob("step-*"))
    assert 2 <= restored < steps, "killed mid-run, after a checkpoint"
    resumed = subprocess.run([*command, "--resume", str(run_dir)], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    metrics = check_run(run_dir, 0, resumed_at=restored, steps=steps)
    assert [r["version"] for r in records(run_dir, "training-0") if r["kind"] == "train_start"] == [0, restored]
    for m in metrics:  # the prompt sequence carries on where the checkpoint left it
        rows = sorted(m["row_ids"] + [d["row"] for d in m["dropped"]])
        assert rows == list(range((m["version"] - 1) * GROUPS * GROUP, m["version"] * GROUPS * GROUP))


def test_the_same_recipe_and_seed_replay_the_same_rewards_in_lock_step(tmp_path):
    runs = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        recipe = small_recipe(tmp_path / name, "1", steps=6)
        text = recipe.read_text().replace(
            'reward = "meshy.recipes.tasks.arithmetic:exact_match"',
            'reward = "tests.recipes.length_reward:length_reward"',
        )
        recipe.write_text(text)  # a reward of every sampled token: equal rewards mean equal samples
        runs.append(check_run(run(recipe), 0, steps=6))
    first, second = ([(m["version"], m["row_ids"], m["reward_mean"]) for m in metrics] for metrics in runs)
    assert first == second  # the same samples, trained in the same rows and versions
    assert len({reward for _, _, reward in first}) > 1, "rewards that vary, so equality means something"
    # Equal up to rounding: an engine's logprobs (which the loss reads) move by ~1e-6 with which requests
    # share its batches, and that depends on when the prompts reach it; a different row would move the
    # loss by far more.
    for a, b in zip(*runs, strict=True):
        assert (a["loss"], a["grad_norm"]) == pytest.approx((b["loss"], b["grad_norm"]), rel=1e-5, abs=1e-7)


@pytest.mark.slow  # the default tier resumes a killed GRPO run; this adds the critic's checkpoints
def test_a_killed_ppo_run_resumes_its_critic_from_the_checkpoint_of_the_policy_version(tmp_path):
    steps = 10
    recipe = small_recipe(tmp_path, "1", tail="\n[roles.critic]\nprocesses = 1\n", steps=steps)
    text = recipe.read_text().replace('kind = "grpo"', 'kind = "ppo"')
    recipe.write_text(re.sub(r"^checkpoint_every = .*$", "checkpoint_every = 2", text, flags=re.M))
    command = [sys.executable, "-m", "meshy.recipes.cli", "run"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    crashed = subprocess.Popen([*command, str(recipe)], env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        deadline, run_dir = time.monotonic() + 240, None
        while time.monotonic() < deadline and crashed.poll() is None:
            run_dir = next((p for p in tmp_path.iterdir() if p.is_dir()), None)
            saved = run_dir is not None and list((run_dir / "critic_checkpoints").glob("step-*"))
            if saved and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 5 and checkpointed(run_dir):
                break
            time.sleep(0.05)
        assert run_dir is not None and crashed.poll() is None, "the run should still be going at version 5"
    finally:
        kill_tree(crashed)
        crashed.wait()
    policy = max(int(p.name.removeprefix("step-")) for p in (run_dir / "checkpoints").glob("step-*"))
    critic = [int(p.name.removeprefix("step-")) for p in (run_dir / "critic_checkpoints").glob("step-*")]
    expected = max(v for v in critic if v <= policy)
    resumed = subprocess.run([*command, "--resume", str(run_dir)], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    check_run(run_dir, 0, resumed_at=policy, steps=steps)
    starts = [r for r in records(run_dir, "critic-0") if r["kind"] == "critic_start"]
    assert [s["version"] for s in starts] == [0, expected] and starts[0]["steps"] == 0
    assert starts[1]["steps"] > 0, "the critic carried on from its saved state, not from a fresh one"


@pytest.mark.parametrize("delta", [False, True])
def test_weights_broadcast_to_two_engines_reach_every_engine_every_version(tmp_path, delta):
    """publish = "collective": two FSDP training ranks gather each version and rank 0 broadcasts it (or,
    with delta, what changed) to two inference processes on the weight-sync group; each engine verifies
    the checksum (the trainer's full tensors) before it loads. Nothing is written under weights/; every
    2nd version is kept as an HF directory (hf_every), the last one the final weights."""
    top = f'publish = "collective"\ndelta = {str(delta).lower()}\nhf_every = 2\n'
    recipe = small_recipe(tmp_path, "1", top=top)
    text = recipe.read_text().replace("[roles.training]\nprocesses = 1", "[roles.training]\nprocesses = 2")
    recipe.write_text(text.replace("[roles.inference]\nprocesses = 1", "[roles.inference]\nprocesses = 2"))
    run_dir = run(recipe)
    check_run(run_dir, 0)
    for engine in ("inference-0", "inference-1"):
        stats = records(run_dir, engine)[-1]
        assert stats["failed_loads"] == 0 and stats["versions"][-1] == STEPS, stats
    assert not (run_dir / "weights").exists() or not any((run_dir / "weights").iterdir())
    kept = sorted(p.name for p in (run_dir / "hf_versions").iterdir())
    assert kept == [f"v{v:06d}" for v in range(0, STEPS + 1, 2)]
    last = dict(HFDirectory.open(run_dir / "hf_versions" / kept[-1]).tensors())
    final = dict(HFDirectory.open(run_dir / "final_weights").tensors())
    assert last.keys() == final.keys()
    for name, tensor in final.items():
        assert torch.equal(last[name], tensor), name
