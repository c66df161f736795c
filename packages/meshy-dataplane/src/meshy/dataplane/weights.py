"""The `weights` control stream's contract between whoever publishes weights and whoever loads them.

A message announces one version: where it is (an HF safetensors directory, or shared-memory buckets on
this host), its size and a checksum of its tensors. `read_published` verifies the checksum before it
returns anything, so a truncated or corrupted version is refused whole.
"""

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from multiprocessing import shared_memory

import torch
import xxhash

from meshy.dataplane.errors import DataPlaneError, SchemaError
from meshy.dataplane.hf_directory import HFDirectory

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
    checksum: xxh3-128 over the tensors (integrity against torn or truncated writes, not tampering).
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


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """Digest of one tensor's dtype, shape and bytes."""
    digest = xxhash.xxh3_128(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.digest()


def combine_digests(digests: Mapping[str, bytes]) -> str:
    """The checksum of a version: its tensors' digests in name order, so it does not depend on how the
    tensors are laid out in files or buckets, and each digest can be computed as its tensor goes by."""
    digest = xxhash.xxh3_128()
    for name in sorted(digests):
        digest.update(name.encode())
        digest.update(digests[name])
    return digest.hexdigest()


def tensors_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    return combine_digests({name: tensor_digest(t) for name, t in tensors.items()})


def read_published(published: Published) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, HF name -> tensor) of a version, after verifying its checksum."""
    if published.format == DISK:
        with _corrupt_if_unreadable(published):
            directory = HFDirectory.open(published.location)
            tensors = dict(directory.tensors())
            _check_checksum(published, tensors_checksum(tensors))
            return directory.config(), tensors  # config.json is not covered by the checksum
    if published.format == SHARED_MEMORY:
        return _read_shared_memory(published)
    raise SchemaError(f"weights v{published.version}: format {published.format!r} is not {DISK} or {SHARED_MEMORY}")


def verify_published(published: Published) -> tuple[HFDirectory, dict, dict[str, tuple[int, ...]]]:
    """A published directory's (directory, config.json, tensor shapes), after checking its tensors against
    the announced checksum. Holds one tensor at a time (read_published holds the whole model)."""
    if published.format != DISK:
        raise SchemaError(f"weights v{published.version}: format {published.format!r}: expected {DISK}")
    with _corrupt_if_unreadable(published):
        directory = HFDirectory.open(published.location)
        digests, shapes = {}, {}
        for name, tensor in directory.tensors():
            digests[name], shapes[name] = tensor_digest(tensor), tuple(tensor.shape)
        _check_checksum(published, combine_digests(digests))
        return directory, directory.config(), shapes


@contextlib.contextmanager
def _corrupt_if_unreadable(published: Published) -> Iterator[None]:
    """A published directory that cannot be read is a corrupt version (it was complete when announced)."""
    try:
        yield
    except SchemaError as e:
        raise CorruptWeights(f"weights v{published.version}: {e}") from None


def _check_checksum(published: Published, checksum: str) -> None:
    if checksum != published.checksum:
        raise CorruptWeights(f"weights v{published.version} at {published.location}: checksum mismatch")


def _read_shared_memory(published: Published) -> tuple[dict, dict[str, torch.Tensor]]:
    meta = json.loads(published.location)
    try:
        buckets = {name: shared_memory.SharedMemory(name=name) for name in meta["buckets"]}
    except FileNotFoundError as e:
        raise CorruptWeights(f"weights v{published.version}: shared-memory bucket gone ({e})") from None
    try:
        tensors = {}
        for entry in meta["tensors"]:
            dtype, count = DTYPES[entry["dtype"]], torch.Size(entry["shape"]).numel()
            # Cloned in one expression, so no view of the bucket outlives it (buckets get unlinked).
            tensors[entry["name"]] = (
                torch.frombuffer(buckets[entry["bucket"]].buf, dtype=dtype, count=count, offset=entry["offset"])
                .view(entry["shape"])
                .clone()
            )
        if tensors_checksum(tensors) != published.checksum:
            raise CorruptWeights(f"weights v{published.version} in shared memory: checksum mismatch")
        return meta["config"], tensors
    finally:
        for shm in buckets.values():
            shm.close()
