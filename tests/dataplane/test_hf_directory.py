"""The one HF model directory reader: what it returns, and the error each bad directory gets."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from meshy.dataplane import SchemaError
from meshy.dataplane.hf_directory import HFDirectory, check_tensor_shapes
from meshy.dataplane.model_source import read_model

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 16}
SHARDS = {
    "model-00001-of-00002.safetensors": {"embed.weight": (16, 4), "norm.weight": (4,)},
    "model-00002-of-00002.safetensors": {"head.weight": (16, 4)},
}


def write_directory(path: Path, shards: dict = SHARDS, index: bool = True) -> Path:
    """A two-shard directory with its index; each tensor filled with its shard's number."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    for i, (file, shapes) in enumerate(shards.items()):
        save_file({name: torch.full(shape, float(i), device="cpu") for name, shape in shapes.items()}, path / file)
    if index:
        weight_map = {name: file for file, shapes in shards.items() for name in shapes}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_a_sharded_directory_reads_whole_and_its_shapes_come_from_the_headers(tmp_path):
    directory = HFDirectory.open(write_directory(tmp_path / "m"))
    config, tensors = directory.read()
    assert config == CONFIG
    assert {name: tuple(t.shape) for name, t in tensors.items()} == directory.shapes()
    assert directory.shapes() == {"embed.weight": (16, 4), "norm.weight": (4,), "head.weight": (16, 4)}
    assert tensors["head.weight"].device.type == "cpu" and tensors["head.weight"].eq(1).all()
    assert read_model(tmp_path / "m")[1].keys() == tensors.keys()


@pytest.mark.parametrize(
    ("damage", "error"),
    [
        (lambda d: d.rename(d.with_name("gone")), "{d}: not a directory; expected an HF model directory"),
        (lambda d: (d / "config.json").unlink(), "{d}: no config.json; expected an HF model directory"),
        (lambda d: [p.unlink() for p in d.glob("*.safetensors")], "{d}: no *.safetensors file; expected"),
        (lambda d: (d / "config.json").write_text("[1]"), "{d}/config.json: expected a JSON object, got list"),
        (lambda d: (d / "config.json").write_text("{"), "{d}/config.json: not valid JSON"),
    ],
    ids=["not-a-directory", "no-config", "no-shards", "config-list", "torn-config"],
)
def test_a_directory_without_its_files_names_what_is_missing(tmp_path, damage, error):
    path = write_directory(tmp_path / "m")
    damage(path)
    with pytest.raises(SchemaError, match=re.escape(f"model source {error.format(d=path)}")):
        HFDirectory.open(path).read()


def test_a_shard_missing_from_the_index_or_a_tensor_missing_from_its_shard_is_named(tmp_path):
    path = write_directory(tmp_path / "shard-gone")
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SchemaError, match="weight_map names shard model-00002-of-00002.safetensors, which is not in"):
        HFDirectory.open(path).shapes()

    cut = {**SHARDS, "model-00001-of-00002.safetensors": {"embed.weight": (16, 4)}}
    path = write_directory(tmp_path / "tensor-gone", cut, index=False)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: file for file, shapes in SHARDS.items() for name in shapes}})
    )
    with pytest.raises(
        SchemaError, match="tensor norm.weight: expected in model-00001-of-00002.safetensors, found in no shard"
    ):
        dict(HFDirectory.open(path).tensors())


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    twice = {**SHARDS, "model-00002-of-00002.safetensors": {"head.weight": (16, 4), "norm.weight": (4,)}}
    path = write_directory(tmp_path / "m", twice, index=False)
    with pytest.raises(
        SchemaError, match="model-00002-of-00002.safetensors: tensor norm.weight is also in model-00001-of-00002"
    ):
        HFDirectory.open(path).read()


def test_an_unreadable_shard_names_the_file(tmp_path):
    path = write_directory(tmp_path / "m", index=False)
    shard = path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(SchemaError, match=re.escape(f"model source {shard}: not a readable safetensors file")):
        HFDirectory.open(path).read()


def test_tensors_that_do_not_fit_the_expected_names_and_shapes_name_the_tensor():
    expected = {"a": (2, 3), "b": (4,)}
    check_tensor_shapes("weights v1", {"a": (2, 3), "b": (4,)}, expected)
    with pytest.raises(SchemaError, match=r"weights v1: missing tensor b \(1 missing in all\)"):
        check_tensor_shapes("weights v1", {"a": (2, 3)}, expected)
    with pytest.raises(SchemaError, match=r"weights v1: unexpected tensor c \(1 in all\)"):
        check_tensor_shapes("weights v1", {**expected, "c": (1,)}, expected)
    with pytest.raises(SchemaError, match=r"weights v1: tensor a has shape \(3, 2\), expected \(2, 3\)"):
        check_tensor_shapes("weights v1", {"a": (3, 2), "b": (4,)}, expected)


def test_a_source_of_another_kind_is_refused():
    with pytest.raises(SchemaError, match="expected a Published version, an HF model directory or a"):
        read_model(42)
    with pytest.raises(SchemaError, match=r"expected a \(config.json dict, HF name -> tensor mapping\) pair"):
        read_model(({"vocab_size": 4},))
