"""The one reader of a Hugging Face model directory (config.json and *.safetensors, sharded or not) and of a
PEFT adapter directory (adapter_config.json and adapter_model.safetensors, as peft's save_pretrained writes it).

Every problem raises SchemaError naming the file (or tensor) and what was expected, so the engines, the
trainer's init and the published-weights reader all refuse a bad directory the same way. Lives in the
data plane because every role package depends on it and on no other role package.
"""

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from meshy.dataplane.errors import SchemaError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class HFDirectory:
    """A model directory checked to hold config.json and at least one *.safetensors shard.
    Nothing else is read until asked for: `config`, `shapes` (headers only), `tensors` (one at a time)."""

    path: Path
    shards: tuple[Path, ...]

    @classmethod
    def open(cls, directory: str | Path) -> "HFDirectory":
        path = Path(directory)
        expected = f"expected an HF model directory with {CONFIG} and *.safetensors"
        if not path.is_dir():
            raise SchemaError(f"model source {path}: not a directory; {expected}")
        if not (path / CONFIG).is_file():
            raise SchemaError(f"model source {path}: no {CONFIG}; {expected}")
        shards = tuple(sorted(path.glob("*.safetensors")))
        if not shards:
            raise SchemaError(f"model source {path}: no *.safetensors file; {expected}")
        return cls(path, shards)

    def config(self) -> dict:
        return read_config(self.path / CONFIG)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the safetensors headers (no tensor data is read)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for shard, names in self._names():
            with _opened(shard) as tensors:
                shapes.update({name: tuple(tensors.get_slice(name).get_shape()) for name in names})
        return shapes

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor on the host) for every tensor, one at a time (a caller that digests them
        need not hold the whole model)."""
        for shard, names in self._names():
            yield from _tensors_of(shard, names)

    def read(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """(config.json as a dict, HF name -> tensor) of the whole model."""
        return self.config(), dict(self.tensors())

    def _names(self) -> list[tuple[Path, list[str]]]:
        """Each shard with the names it holds, after checking that no name is in two shards and, where
        the directory has an index, that it names exactly the tensors each shard holds."""
        held: dict[str, Path] = {}
        listing = []
        for shard in self.shards:
            with _opened(shard) as tensors:
                names = list(tensors.keys())
            for name in names:
                if name in held:
                    raise SchemaError(
                        f"model source {shard}: tensor {name} is also in {held[name].name}; expected each "
                        "tensor in one shard"
                    )
                held[name] = shard
            listing.append((shard, names))
        if (self.path / INDEX).is_file():
            _check_index(self.path / INDEX, {name: shard.name for name, shard in held.items()})
        return listing


@dataclass(frozen=True)
class AdapterDirectory:
    """A PEFT adapter directory checked to hold adapter_config.json and adapter_model.safetensors."""

    path: Path

    @classmethod
    def open(cls, directory: str | Path) -> "AdapterDirectory":
        path = Path(directory)
        for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            if not (path / file).is_file():
                raise SchemaError(
                    f"adapter source {path}: no {file}; expected a PEFT adapter directory with {ADAPTER_CONFIG} and "
                    f"{ADAPTER_WEIGHTS}"
                )
        return cls(path)

    def config(self) -> dict:
        return read_config(self.path / ADAPTER_CONFIG)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(PEFT name, tensor on the host) for every adapter tensor, one at a time."""
        shard = self.path / ADAPTER_WEIGHTS
        with _opened(shard) as tensors:
            names = list(tensors.keys())
        yield from _tensors_of(shard, names)


def read_config(path: Path) -> dict:
    """A config.json as a dict, or a SchemaError naming the file."""
    try:
        config = json.loads(path.read_bytes())
    except OSError as e:
        raise SchemaError(f"model source {path}: unreadable ({e.strerror})") from None
    except ValueError as e:
        raise SchemaError(f"model source {path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise SchemaError(f"model source {path}: expected a JSON object, got {type(config).__name__}")
    return config


def check_tensor_shapes(
    what: str, shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]
) -> None:
    """Refuse a set of HF-named tensors unless it names exactly the expected tensors, in their shapes
    (checked before anything is loaded, so a set that does not fit changes nothing)."""
    if missing := sorted(expected.keys() - shapes.keys()):
        raise SchemaError(f"{what}: missing tensor {missing[0]} ({len(missing)} missing in all)")
    if unexpected := sorted(shapes.keys() - expected.keys()):
        raise SchemaError(f"{what}: unexpected tensor {unexpected[0]} ({len(unexpected)} in all)")
    for name in sorted(shapes):
        if tuple(shapes[name]) != tuple(expected[name]):
            raise SchemaError(
                f"{what}: tensor {name} has shape {tuple(shapes[name])}, expected {tuple(expected[name])}"
            )


def _tensors_of(shard: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    with _opened(shard) as tensors:
        for name in names:
            try:
                tensor = tensors.get_tensor(name)
            except Exception as e:  # safetensors' own error types: data cut short, bad offsets
                raise SchemaError(f"model source {shard}: tensor {name} is unreadable ({e})") from None
            yield name, tensor


def _opened(shard: Path):
    """safe_open, with a header that cannot be read (a truncated, empty or garbled file) as a SchemaError."""
    try:
        return safe_open(shard, "pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise SchemaError(f"model source {shard}: not a readable safetensors file ({e})") from None


def _check_index(path: Path, held: Mapping[str, str]) -> None:
    """The index's weight_map (tensor -> shard file) must be what the shards hold: a missing shard or
    tensor is a directory copied or written only in part."""
    weight_map = read_config(path).get("weight_map")
    if not isinstance(weight_map, dict):
        raise SchemaError(f"model source {path}: weight_map: expected an object of tensor name -> shard file")
    if absent := sorted(set(weight_map.values()) - set(held.values())):
        raise SchemaError(f"model source {path}: weight_map names shard {absent[0]}, which is not in {path.parent}")
    for name, shard in sorted(weight_map.items()):
        if held.get(name) != shard:
            found = f"found in {held[name]}" if name in held else "found in no shard"
            raise SchemaError(f"model source {path}: tensor {name}: expected in {shard}, {found}")
    if extra := sorted(held.keys() - weight_map.keys()):
        raise SchemaError(f"model source {path}: tensor {extra[0]} (in {held[extra[0]]}) is not in weight_map")
