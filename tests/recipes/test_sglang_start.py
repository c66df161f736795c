"""Every shipped GPU recipe's SGLang engines, started at their real size as far as SGLang checks before it
touches a GPU: each inference and teacher process builds its engine as a run would (meshy.recipes.roles.engines),
from a directory of the real model's config.json and tensor headers (the files are sparse: no weights), and
SGLang's own checks (ServerArgs, resolved and checked as sglang.Engine does, and its ModelConfig) take what
SGLangEngine passes to sglang.Engine, with the environment it sets meanwhile. A miniature swaps in a tiny
model, so only this sees the real model beside the recipe's sizes: JustRL II's context_length, all of
Qwen3-1.7B's 40960 positions, failed here, as on a GPU."""

import json
import struct
from pathlib import Path

import pytest
import torch

from meshy.recipes.recipe import Recipe, load_recipe
from meshy.recipes.recipe.catalog import gpus_needed, shipped
from meshy.recipes.recipe.topology import assign
from meshy.recipes.roles.context import RoleContext
from meshy.recipes.roles.engines import build_engine
from meshy.train.models import DecoderArch, get_model
from meshy.train.titan_models import state_dict_adapter, titan_config
from tests.infer.test_sglang_engine import Started, replace_sglang_engine

pytestmark = pytest.mark.sglang

SGLANG_RECIPES = {
    name: path
    for name, path in sorted(shipped().items())
    if gpus_needed(recipe := load_recipe(path)) and recipe.sampling.engine == "sglang"
}
_DTYPES = {"bfloat16": "BF16", "float32": "F32"}  # safetensors' names
_SHARD_BYTES = 2 << 30  # a shard is mapped whole when its header is read: within a host's address space limits


def test_every_gpu_recipe_runs_sglang():
    assert len(SGLANG_RECIPES) >= 13


@pytest.mark.parametrize("name", sorted(SGLANG_RECIPES))
def test_a_shipped_gpu_recipe_s_sglang_engines_pass_sglang_s_own_checks_at_their_real_size(name, tmp_path, monkeypatch):
    started = []

    def check(**kwargs):  # inside SGLangEngine's environment for the start, as SGLang's processes are
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.server_args import ServerArgs

        server_args = ServerArgs(**kwargs)
        server_args.resolve_once()
        server_args.check_server_args()
        started.append((server_args, ModelConfig.from_server_args(server_args)))

    replace_sglang_engine(monkeypatch, check)
    recipe = load_recipe(SGLANG_RECIPES[name])
    slots = assign(recipe, recipe.world_size, gpus_per_node=recipe.topology.gpus_per_node or gpus_needed(recipe))
    engines = [slot for slot in slots.values() if slot.role in ("inference", "teacher")]
    for slot in engines:
        arch = teacher_arch(recipe) if slot.role == "teacher" else recipe.model.arch()
        ctx = RoleContext(recipe, slot, tmp_path / "run", client=None)
        source = sparse_model(arch, recipe.model.dtype, tmp_path / f"{slot.role}-{slot.index}")
        replay = slot.role == "inference" and recipe.algorithm.routing_replay
        with pytest.raises(Started):  # as the inference and teacher roles build theirs
            build_engine(ctx, source, colocate=slot.ring is not None, record_routing=replay)
    assert len(started) == len(engines) > 0
    for (server_args, model_config), slot in zip(started, engines, strict=True):
        assert server_args.context_length >= recipe.sampling.context_length, slot
        assert model_config.context_len >= recipe.sampling.context_length, slot
        assert server_args.tp_size == len(slot.devices) and server_args.device == "cuda", slot
        assert server_args.enable_memory_saver == (slot.ring is not None), slot


def teacher_arch(recipe: Recipe) -> DecoderArch:
    """The teacher's architecture: the model the shipped recipes name on the hub (hf:Qwen/Qwen3-8B)."""
    return get_model(recipe.model.teacher.removeprefix("hf:").split("/")[-1].lower())


def sparse_model(arch: DecoderArch, dtype: str, directory: Path) -> Path:
    """An HF directory of `arch`: its config.json, and safetensors shards whose headers list every tensor
    and whose data are holes (sparse files: nothing written, nothing read before SGLang starts)."""
    with torch.device("meta"):
        state = titan_config(arch).build().state_dict()
    torch_dtype = getattr(torch, dtype)
    shards: list[dict] = [{}]
    offset = 0
    for tensor_name, tensor in state_dict_adapter(arch).to_hf(state).items():
        size = tensor.numel() * torch_dtype.itemsize
        if offset and offset + size > _SHARD_BYTES:
            shards.append({})
            offset = 0
        shards[-1][tensor_name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(arch.hf_config(dtype)))
    for i, header in enumerate(shards):
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(directory / f"model-{i:05d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(encoded)) + encoded)
            f.truncate(8 + len(encoded) + max(entry["data_offsets"][1] for entry in header.values()))
    return directory
