"""A shipped GPU recipe in miniature: the same run (algorithm, loss, pacing, dtype, activation
checkpointing, FSDP and expert parallelism, colocation rings, publishing, roles) at a size two CPU cores
run in half a minute. Changed: the model (the tiny one of its family, from scratch), the task (the
default's arithmetic problems, rewarded by parity_reward, so that dynamic sampling keeps groups and the
trainer steps; for a multi-turn recipe, the agent tests' echo task), sizes (steps, groups, tokens, at most
two processes a role), devices (CPU), engines (TorchEngine, or SGLang on its CPU path) and nodes (one).
A recipe whose context takes every position of its model keeps that: its miniature's takes the tiny model's."""

import json
import tomllib
from pathlib import Path

from meshy.recipes.recipe import DEFAULT_RECIPE
from meshy.train.models import get_model
from tests.recipes.agent_task import SmallTokenizer

STEPS, GROUPS, GROUP = 3, 4, 4  # GROUPS and GROUP as tests.recipes.test_pipeline's, whose checks apply
RANKS = 2  # at most this many processes a role
TINY = (("qwen3-30b-a3b", "qwen3-tiny-moe"), ("qwen3-", "qwen3-tiny"), ("minicpm5-", "minicpm5-tiny"))


def tiny_model(name: str) -> str:
    """The tiny model of a shipped model's family."""
    return next(tiny for prefix, tiny in TINY if name.startswith(prefix))


def miniature(shipped: Path, run_dir: Path, teacher: Path | None = None, engine: str = "torch") -> dict:
    """The recipe at `shipped` in miniature, writing under run_dir; teacher: HF weights of the tiny model
    for a recipe with a teacher. engine "sglang": inference and teacher on SGLang, one process each (an
    engine's start takes most of a CPU core for a minute)."""
    data = tomllib.loads(shipped.read_text())
    default = tomllib.loads(DEFAULT_RECIPE.read_text())
    data.pop("topology", None)
    data.update(steps=STEPS, run_dir=str(run_dir), stall_after_s=120.0)
    if data.get("checkpoint_every"):
        data["checkpoint_every"] = 2
    if data.get("hf_every"):
        data["hf_every"] = 1  # the last kept version is the final one
    model = data["model"]
    whole_context = data["sampling"].get("context_length") == get_model(model["name"]).max_position_embeddings
    model.update(name=tiny_model(model["name"]), init="scratch", overrides=default["model"]["overrides"])
    if "teacher" in model:
        assert teacher is not None, f"{shipped.name} has a teacher: pass its tiny weights"
        model["teacher"] = str(teacher)
    data["task"] = {**default["task"], "reward": "tests.recipes.parity_reward:parity_reward"}
    tokens = {"max_new_tokens": 3, "context_length": 16}
    if whole_context:  # as JustRL II's 40960 of Qwen3-1.7B's positions: SGLang starts past it, when told to
        tokens["context_length"] = get_model(model["name"]).max_position_embeddings
    if "agent" in data:  # multi-turn: the echo task of the agent tests stands in for a tool task
        data["task"] = {f: f"tests.recipes.agent_task:{f}" for f in ("tokenizer", "problems", "environment")}
        data["agent"] = {"max_turns": 3, "max_tokens": 160, "enable_thinking": False}
        model["overrides"] = {"vocab_size": SmallTokenizer.vocab_size}
        tokens = {"max_new_tokens": 40, "context_length": 512}
    algorithm = data["algorithm"]
    algorithm.update(group_size=GROUP, prompts_per_step=GROUPS)
    if algorithm.get("overlong_buffer"):
        algorithm["overlong_buffer"] = 1
    if algorithm.get("critic_warmup_versions"):
        algorithm["critic_warmup_versions"] = 1
    parallel = algorithm.get("parallel", {})
    for axis in ("dp_shard", "ep"):
        if parallel.get(axis, 1) > 1:
            parallel[axis] = RANKS
    data["sampling"].update(engine=engine, max_in_flight=64, **tokens)
    single = ("rollout", "environment") + (("inference", "teacher") if engine == "sglang" else ())
    for name, role in data["roles"].items():
        role["processes"] = min(role["processes"], 1 if name in single else RANKS)
        for placement in ("devices_per_process", "memory_fraction", "node"):
            role.pop(placement, None)
    return data


def toml(data: dict, table: str = "") -> str:
    """TOML text of parsed TOML (strings, numbers, booleans, lists, tables)."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict) or not v}
    tables = {k: v for k, v in data.items() if isinstance(v, dict) and v}
    lines = [f"[{table}]"] if table and (scalars or not tables) else []
    lines += [f"{key} = {_value(value)}" for key, value in scalars.items()]
    for key, value in tables.items():
        lines += ["", toml(value, f"{table}.{key}" if table else key)]
    return "\n".join(lines) + ("\n" if not table else "")


def _value(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return json.dumps(value)
