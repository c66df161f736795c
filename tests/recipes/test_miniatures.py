"""Every shipped GPU recipe runs end to end on the CPU in miniature (tests/recipes/miniature.py): the
combination of features it ships (dtype, activation checkpointing, FSDP and expert parallelism over
several ranks, rings, pacing, dynamic sampling, TIS, PPO's critic, a teacher, checkpoints) runs as the
recipe combines them, which no GPU here can. Recipes whose miniatures are the same run share one."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshy.recipes.recipe import load_recipe
from meshy.recipes.recipe.catalog import gpus_needed, shipped
from meshy.recipes.roles.rollout import FREE_BATCHES
from meshy.train import checkpoint
from tests.infer.test_sglang_engine import use_stub_kernels
from tests.recipes.miniature import STEPS, miniature, toml
from tests.recipes.test_pipeline import check_run, check_turns, records, run, sharp_teacher

# Recipes without a ring whose miniatures also run with SGLang: a teacher, a critic, broadcast versions,
# MiniCPM5's Llama layout.
SGLANG_RUNS = (
    "distill-qwen3-8b-to-1.7b-8gpu",
    "justrl2-ppo-qwen3-1.7b-8gpu",
    "qwen3-1.7b-grpo-dapo-2x8gpu",
    "minicpm5-1b-grpo-ultradata-8gpu",
)
GPU_RECIPES = {name: path for name, path in sorted(shipped().items()) if gpus_needed(load_recipe(path))}


def same_runs() -> list[list[str]]:
    """The GPU recipes, grouped by miniature: those in a group differ only in what a miniature replaces."""
    groups: dict[str, list[str]] = {}
    for name, path in GPU_RECIPES.items():
        data = miniature(path, Path("run"), teacher=Path("teacher"))
        data.pop("name")
        groups.setdefault(json.dumps(data, sort_keys=True), []).append(name)
    return list(groups.values())


def test_every_gpu_recipe_has_a_miniature():
    names = [name for group in same_runs() for name in group]
    assert sorted(names) == sorted(GPU_RECIPES) and len(GPU_RECIPES) >= 13


@pytest.mark.slow
@pytest.mark.parametrize("names", same_runs(), ids=lambda names: names[0])
def test_a_shipped_gpu_recipe_runs_in_miniature_on_the_cpu(names, tmp_path):
    run_miniature(names[0], tmp_path, "torch")


@pytest.mark.sglang
@pytest.mark.parametrize("name", SGLANG_RUNS)
def test_a_shipped_gpu_recipe_runs_in_miniature_with_sglang_engines(name, tmp_path):
    """Inference (and the teacher) on SGLang, as every GPU recipe ships, on its CPU path. Recipes without
    a ring: on the CPU SGLang cannot release its memory (its memory saver needs CUDA)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (uv sync --extra sglang)")
    assert not load_recipe(GPU_RECIPES[name]).colocate
    use_stub_kernels()
    run_dir = run_miniature(name, tmp_path, "sglang")
    for process in ("inference-0",) + ("teacher-0",) * bool(load_recipe(GPU_RECIPES[name]).roles.teacher):
        (built,) = [r for r in records(run_dir, process) if r["kind"] == "engine"]
        assert (built["engine"], built["dtype"]) == ("SGLangEngine", "bfloat16"), built


def run_miniature(name: str, tmp_path: Path, engine: str) -> Path:
    """Runs the recipe's miniature and checks its ledger and what its features left behind."""
    shipped_path = GPU_RECIPES[name]
    teacher = sharp_teacher(tmp_path / "teacher") if load_recipe(shipped_path).model.teacher else None
    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / "recipe.toml"
    path.write_text(toml(miniature(shipped_path, tmp_path / "run", teacher=teacher, engine=engine)))
    recipe = load_recipe(path)
    algo = recipe.algorithm
    run_dir = run(path)

    enforced = algo.max_staleness is not None
    staleness = algo.max_staleness if enforced else FREE_BATCHES if algo.window is None else algo.window - 1
    architecture = recipe.model.arch().architecture
    metrics = check_run(run_dir, staleness, steps=STEPS, architecture=architecture, enforced=enforced)
    assert sum(m["rows_trained"] for m in metrics), "the policy trained on some rows"
    for ring in recipe.colocate:
        for index in range(min(getattr(recipe.roles, role).processes for role in ring)):
            check_turns(run_dir, list(ring), index)
    # A LoRA run's final_weights/ (and kept versions) are PEFT adapters (meshy.recipes.roles.training)
    weights = "adapter_model.safetensors" if recipe.model.lora is not None else "model.safetensors"
    final = load_file(run_dir / "final_weights" / weights)
    if recipe.model.dtype == "bfloat16":  # whatever the transport (shared memory and broadcasts wrote float32)
        assert {t.dtype for t in final.values()} == {torch.bfloat16}
    if recipe.hf_every:
        kept = sorted((run_dir / "hf_versions").iterdir())
        assert [p.name for p in kept] == [f"v{v:06d}" for v in range(0, STEPS + 1, recipe.hf_every)]
        last = load_file(kept[-1] / weights)
        assert last.keys() == final.keys() and all(torch.equal(last[k], final[k]) for k in final)
    if recipe.checkpoint_every:
        saved = [checkpoint.step_of(p) for p in checkpoint.saved(run_dir / "checkpoints")]
        assert saved == list(range(recipe.checkpoint_every, STEPS + 1, recipe.checkpoint_every)), saved
    for role in ("critic", "teacher"):
        spec = getattr(recipe.roles, role)
        for index in range(spec.processes if spec else 0):
            done = records(run_dir, f"{role}-{index}")[-1]
            assert (done["steps"] if role == "critic" else done["rows"]) > 0, done
    return run_dir
