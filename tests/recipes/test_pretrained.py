"""model.init's HF directory is checked against the model's shape when a recipe loads."""

import json
import re
from pathlib import Path

import pytest

from meshy.dataplane import SchemaError
from meshy.recipes.weights.pretrained import check_init
from meshy.train.models import get_model


def checkpoint(directory: Path, config: dict) -> str:
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"")
    return str(directory)


def test_a_checkpoint_may_set_its_own_token_ids_and_context_length(tmp_path):
    arch = get_model("qwen3-tiny")
    config = {**arch.hf_config(), "bos_token_id": None, "eos_token_id": [0, 2], "max_position_embeddings": 4096}
    check_init(checkpoint(tmp_path, config), arch)


def test_a_checkpoint_whose_router_differs_is_refused(tmp_path):
    arch = get_model("qwen3-tiny-moe")
    init = checkpoint(tmp_path, {**arch.hf_config(), "norm_topk_prob": False})
    message = f"init: {tmp_path / 'config.json'} has norm_topk_prob = False, the model expects True"
    with pytest.raises(SchemaError, match=re.escape(message)):
        check_init(init, arch)
