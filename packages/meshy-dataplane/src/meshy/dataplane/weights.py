"""The `weights` control stream's contract between whoever publishes weights and whoever loads them.

A message announces one version: where it is (an HF safetensors directory, or shared-memory buckets on
this host), its size and a checksum. `read_published` verifies the checksum before handing out a single
tensor, so a truncated or corrupted version is refused whole.
"""

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from multiprocessing import shared_memory
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file

from meshy.dataplane.errors import DataPlaneError, SchemaError

WEIGHTS_STREAM = "weights"
DISK = "hf-safetensors"
SHARED_MEMORY = "shared-memory"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class CorruptWeights(DataPlaneError):
    """Published weights whose bytes do not match the checksum they were announced with."""


@dataclass(frozen=True)
class Published:
    """One version as announced on the `weights` stream.

    location: the directory (DISK), or the JSON manifest of buckets (SHARED_MEMORY).
    checksum: xxh3-128 over the payload bytes (integrity against torn or truncated writes, not tampering).
    """

    version: int
    format: str
    location: str
    checksum: str
    num_bytes: int
    seconds: float

    def to_message(self) -> dict:
        return asdict(self)

    @classmethod
    def from_message(cls, message: dict) -> "Published":
        try:
            return cls(**message)
        except TypeError as e:
            raise SchemaError(f"weights message: expected the fields of Published, got {sorted(message)}") from e


def checksum(chunks: Iterable[bytes | memoryview]) -> str:
    digest = xxhash.xxh3_128()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def directory_checksum(directory: Path) -> str:
    """Over the safetensors files of a directory, in name order."""

    def chunks():
        for shard in sorted(directory.glob("*.safetensors")):
            yield shard.name.encode()
            with open(shard, "rb") as f:
                while chunk := f.read(16 << 20):
                    yield chunk

    return checksum(chunks())


def read_published(published: Published) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, HF name -> tensor) of a version, after verifying its checksum."""
    if published.format == DISK:
        directory = Path(published.location)
        if not directory.is_dir():
            raise CorruptWeights(f"weights v{published.version}: no directory {directory}")
        if directory_checksum(directory) != published.checksum:
            raise CorruptWeights(f"weights v{published.version} at {directory}: checksum mismatch")
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(directory.glob("*.safetensors")):
            tensors.update(load_file(shard))
        return json.loads((directory / "config.json").read_text()), tensors
    if published.format == SHARED_MEMORY:
        return _read_shared_memory(published)
    raise SchemaError(f"weights v{published.version}: format {published.format!r} is not {DISK} or {SHARED_MEMORY}")


def _read_shared_memory(published: Published) -> tuple[dict, dict[str, torch.Tensor]]:
    meta = json.loads(published.location)
    try:
        buckets = {name: shared_memory.SharedMemory(name=name) for name in meta["buckets"]}
    except FileNotFoundError as e:
        raise CorruptWeights(f"weights v{published.version}: shared-memory bucket gone ({e})") from None
    try:
        if checksum(buckets[n].buf[:size] for n, size in meta["buckets"].items()) != published.checksum:
            raise CorruptWeights(f"weights v{published.version} in shared memory: checksum mismatch")
        tensors = {}
        for entry in meta["tensors"]:
            dtype, count = DTYPES[entry["dtype"]], torch.Size(entry["shape"]).numel()
            # Cloned in one expression, so no view of the bucket outlives it (buckets get unlinked).
            tensors[entry["name"]] = (
                torch.frombuffer(buckets[entry["bucket"]].buf, dtype=dtype, count=count, offset=entry["offset"])
                .view(entry["shape"])
                .clone()
            )
        return meta["config"], tensors
    finally:
        for shm in buckets.values():
            shm.close()
