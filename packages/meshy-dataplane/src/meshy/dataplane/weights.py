"""The `weights` control stream's contract between whoever publishes weights and whoever loads them.

A message announces one version: where it is (an HF safetensors directory, shared-memory buckets on
this host, or buckets that follow on the weight-sync process group: meshy.dataplane.weight_sync), its
size and a checksum of its tensors. Readers verify the checksum before they return anything, so a
truncated or corrupted version is refused whole.

Buckets (shared memory, collective) are flat byte buffers; the announcement's manifest says where each
tensor lies in which bucket (name, dtype, shape, bucket, offset, nbytes).
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
COLLECTIVE = "collective"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_BUCKET_DTYPES = {**DTYPES, "int32": torch.int32}  # a delta's indices travel in buckets too


class CorruptWeights(DataPlaneError):
    """Published weights whose bytes do not match the checksum they were announced with."""


@dataclass(frozen=True)
class Published:
    """One version as announced on the `weights` stream.

    location: the directory (DISK), or the JSON of config.json, bucket sizes and the tensors' manifest
        (SHARED_MEMORY, COLLECTIVE).
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
    raise SchemaError(
        f"weights v{published.version}: format {published.format!r} is not {DISK} or {SHARED_MEMORY} "
        f"({COLLECTIVE} versions are received on the weight-sync group: meshy.dataplane.weight_sync)"
    )


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
        where = f"at {published.location}" if published.format == DISK else f"({published.format})"
        raise CorruptWeights(f"weights v{published.version} {where}: checksum mismatch")


def _aligned(offset: int, tensor: torch.Tensor) -> int:
    """The first offset >= `offset` at which `tensor` can be viewed in place (a multiple of its item size)."""
    return -(-offset // tensor.element_size()) * tensor.element_size()


def bucket_nbytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    """The size of a bucket holding `tensors`, each at an offset its dtype can be viewed at."""
    offset = 0
    for _, tensor in tensors:
        offset = _aligned(offset, tensor) + tensor.numel() * tensor.element_size()
    return offset


def pack_bucket(buffer: torch.Tensor, bucket: str, tensors: list[tuple[str, torch.Tensor]], manifest: list) -> None:
    """Copy `tensors` one after another into `buffer` (flat uint8 of bucket_nbytes(tensors)), recording
    each one's place in `manifest`."""
    offset = 0
    for name, tensor in tensors:
        offset = _aligned(offset, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        buffer[offset : offset + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        manifest.append(
            {
                "name": name,
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "bucket": bucket,
                "offset": offset,
                "nbytes": nbytes,
            }
        )
        offset += nbytes


def unpack_buckets(manifest: list, buffers: Mapping[str, torch.Tensor], copy: bool = True) -> dict[str, torch.Tensor]:
    """Name -> tensor, as the manifest lays them out. copy: tensors are copies, so no view of a bucket
    outlives it (shared memory gets unlinked); without, they are views into `buffers` (no second copy)."""
    tensors = {}
    for entry in manifest:
        start, end = entry["offset"], entry["offset"] + entry["nbytes"]
        view = buffers[entry["bucket"]][start:end].view(_BUCKET_DTYPES[entry["dtype"]]).view(entry["shape"])
        tensors[entry["name"]] = view.clone() if copy else view
        del view  # no view of a bucket is left in this frame (a traceback would keep it alive)
    return tensors


def verify(published: Published, tensors: Mapping[str, torch.Tensor]) -> None:
    """CorruptWeights unless `tensors` are the version `published` announced."""
    _check_checksum(published, tensors_checksum(tensors))


def _read_shared_memory(published: Published) -> tuple[dict, dict[str, torch.Tensor]]:
    meta = json.loads(published.location)
    try:
        buckets = {name: shared_memory.SharedMemory(name=name) for name in meta["buckets"]}
    except FileNotFoundError as e:
        raise CorruptWeights(f"weights v{published.version}: shared-memory bucket gone ({e})") from None
    try:
        buffers = {
            name: torch.frombuffer(shm.buf, dtype=torch.uint8, count=max(meta["buckets"][name], 1))
            for name, shm in buckets.items()
        }
        try:
            tensors = unpack_buckets(meta["tensors"], buffers)
            verify(published, tensors)
            return meta["config"], tensors
        finally:
            del buffers  # no view of a bucket may outlive it (buckets get unlinked)
    finally:
        for shm in buckets.values():
            shm.close()
