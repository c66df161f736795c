"""SGLangEngine's start, up to sglang.Engine, without SGLang: what it hands sglang.Engine for each source
it starts from, and what it refuses first. A stand-in for the few sglang names the start reaches records
sglang.Engine's arguments and the directory it is given, then raises (the SGLang tier,
tests/infer/test_sglang_engine.py, starts the real one)."""

import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from meshy.dataplane import SchemaError
from meshy.dataplane.weights import Published, Transport
from meshy.infer.sglang_engine import SGLangEngine
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.publish import DirectoryPublisher, SharedMemoryPublisher, hf_tensors
from meshy.train.training_config import ParallelConfig

ARCH = get_model("qwen3-tiny")


class Started(Exception):
    """What the stand-in for sglang.Engine raises once it has its arguments."""


@pytest.fixture
def started(monkeypatch) -> dict:
    """sglang as far as SGLangEngine's start reaches; sglang.Engine fills the returned dict with its
    arguments, and the files of its model_path as they are while it starts."""
    arguments: dict = {}

    def engine(**kwargs):
        path = Path(kwargs["model_path"])
        arguments.update(kwargs, files={p.name: p.read_text() for p in path.iterdir() if p.suffix == ".json"})
        raise Started

    stand_ins = {
        "sglang": {"Engine": engine},
        "sglang.srt": {},
        "sglang.srt.utils": {"is_cpu": lambda: True},
        "sglang.srt.utils.hf_transformers": {},
        "sglang.srt.utils.hf_transformers.common": {"get_context_length": lambda c: c.max_position_embeddings},
    }
    for name, attributes in stand_ins.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(__name__=name, **attributes))
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")  # the start sets it; put back afterwards
    return arguments


def model() -> torch.nn.Module:
    return build_model(ARCH, ParallelConfig(), device="cpu", seed=0)[0]


def test_from_tensors_in_memory_sglang_starts_from_config_json_alone_in_a_directory_removed_after(started):
    config = ARCH.hf_config("float32")
    tensors = dict(hf_tensors(model(), ARCH, torch.float32))
    with pytest.raises(Started):
        SGLangEngine((config, tensors), device="cpu", dtype="float32", max_len=64, max_running=2, version=3)
    assert started["load_format"] == "dummy" and started["weight_version"] == "3"
    assert started["files"] == {"config.json": json.dumps(config)}
    assert not os.path.exists(started["model_path"]), "the temporary directory goes once SGLang has started"
    assert started["context_length"] > 64 and started["max_total_tokens"] == 2 * started["context_length"]


def test_from_a_published_directory_sglang_loads_the_directory_at_its_version(started, tmp_path):
    published = DirectoryPublisher(tmp_path, ARCH, dtype="float32").publish(model(), 5)
    with pytest.raises(Started):
        SGLangEngine(published, device="cpu", dtype="float32", max_len=64)
    assert started["model_path"] == published.location and started["weight_version"] == "5"
    assert "load_format" not in started and "max_total_tokens" not in started
    assert os.path.isdir(published.location)


def test_versions_that_cannot_start_an_engine_are_refused_before_sglang_starts(started, unique):
    publisher = SharedMemoryPublisher(unique("meshy-start-test"), ARCH, dtype="float32")
    try:
        shared = publisher.publish(model(), 1)
        assert shared.transport is Transport.SHARED_MEMORY
        with pytest.raises(SchemaError, match="a shared-memory version cannot start an engine; start from a disk"):
            SGLangEngine(shared, device="cpu")
    finally:
        publisher.close()
    meta = {"config": ARCH.hf_config("float32"), "buckets": {}, "tensors": []}
    broadcast = Published(2, Transport.COLLECTIVE, json.dumps(meta), "", 0, 0.0)
    with pytest.raises(SchemaError, match="needs its place in the group"):
        SGLangEngine(broadcast, device="cpu")
    delta = Published(3, Transport.COLLECTIVE, json.dumps({**meta, "delta": {"base": 2}}), "", 0, 0.0)
    with pytest.raises(SchemaError, match="v3 is a delta; an engine starts from a whole one"):
        SGLangEngine(delta, device="cpu", weight_sync_rank=1)
    assert started == {}
