"""The `weights` control stream's contract between whoever publishes weights and whoever loads them.

A message announces one version: how it travels (its Transport: an HF safetensors directory,
shared-memory buckets on this host, or buckets that follow on the weight-sync process group:
meshy.dataplane.weight_sync), where it is, its size and a checksum of its tensors. Readers verify the
checksum before they return anything, so a truncated or corrupted version is refused whole.

Buckets (shared memory, collective) are flat byte buffers; the announcement's manifest says where each
tensor lies in which bucket (name, dtype, shape, bucket, offset, nbytes).

A LoRA version (Published.adapter: meshy.dataplane.adapters) is its adapters; its base is kept once where the
transport keeps it (`<root>/base` beside the version directories; shared-memory buckets of its own, described
under "base" in each version's location) or carried by the collective versions that need it, and is checked
against Adapter.base whenever it is read.
"""

import contextlib
import json
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from multiprocessing import shared_memory
from pathlib import Path

import torch
import xxhash

from meshy.dataplane.adapters import Adapter
from meshy.dataplane.devices import HOST
from meshy.dataplane.errors import DataPlaneError, SchemaError
from meshy.dataplane.hf_directory import ADAPTER_CONFIG, AdapterDirectory, HFDirectory

WEIGHTS_STREAM = "weights"
BASE = "base"  # a LoRA publisher's base directory, beside its versions' directories
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_BUCKET_DTYPES = {**DTYPES, "int32": torch.int32}  # a delta's indices travel in buckets too


def resync_stream(weights_stream: str) -> str:
    """Where an engine that could not rebuild a broadcast version (a delta on a base it does not hold, or a
    checksum mismatch) asks for the next version whole; the publisher reads it before each version."""
    return f"{weights_stream}-resync"


class CorruptWeights(DataPlaneError):
    """Published weights whose bytes do not match the checksum they were announced with."""


class Transport(StrEnum):
    """How versions reach the engines (a recipe's `publish` names one by its value)."""

    DISK = "disk"
    """HF safetensors directories, loadable by `transformers`."""
    SHARED_MEMORY = "shared-memory"
    """Buckets in shared memory on the publisher's host."""
    COLLECTIVE = "collective"
    """Buckets broadcast on the weight-sync group (meshy.dataplane.weight_sync)."""

    @property
    def format(self) -> str:
        """What an announcement of this transport carries as its `format`."""
        return _FORMATS[self]

    @classmethod
    def of_format(cls, format: str) -> "Transport":
        """The transport an announcement's `format` names."""
        for transport, name in _FORMATS.items():
            if name == format:
                return transport
        raise SchemaError(f"weights message: format {format!r}: expected one of {list(_FORMATS.values())}")


# An announcement names a directory by what it holds; the name stays, so announcements a run directory
# keeps (meshy.recipes.roles.reference_weights) read back whichever release wrote them.
_FORMATS = {
    Transport.DISK: "hf-safetensors",
    Transport.SHARED_MEMORY: "shared-memory",
    Transport.COLLECTIVE: "collective",
}


def __getattr__(name: str) -> str:
    """DISK, SHARED_MEMORY and COLLECTIVE, the announcement formats' old names, until 0.3."""
    if name in Transport.__members__:
        warnings.warn(
            f"meshy.dataplane.weights.{name} is Transport.{name}.format (removed in meshy 0.3)",
            DeprecationWarning,
            stacklevel=2,
        )
        return Transport[name].format
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Published:
    """One version as announced on the `weights` stream.

    location: the directory (DISK), or the JSON of config.json, bucket sizes and the tensors' manifest
        (SHARED_MEMORY, COLLECTIVE).
    checksum: xxh3-128 over the tensors (integrity against torn or truncated writes, not tampering).
    adapter: a LoRA version's adapters (meshy.dataplane.adapters); None: the whole model's weights.
    """

    version: int
    transport: Transport
    location: str
    checksum: str
    num_bytes: int
    seconds: float
    adapter: Adapter | None = None

    @property
    def format(self) -> str:
        """The announcement's format (Transport.format); Published.transport says the same, until 0.3."""
        warnings.warn("Published.format is Published.transport.format (removed in meshy 0.3)", DeprecationWarning, 2)
        return self.transport.format

    def to_message(self) -> dict:
        """The stream's message: these fields, with the transport as its `format` (Transport.format)."""
        message = {
            "version": self.version,
            "format": self.transport.format,
            "location": self.location,
            "checksum": self.checksum,
            "num_bytes": self.num_bytes,
            "seconds": self.seconds,
        }
        if self.adapter is not None:
            message["adapter"] = self.adapter.to_dict()
        return message

    @classmethod
    def from_message(cls, message: dict) -> "Published":
        fields = dict(message)
        try:
            adapter = fields.pop("adapter", None)
            adapter = None if adapter is None else Adapter.from_dict(adapter)
            return cls(transport=Transport.of_format(fields.pop("format")), adapter=adapter, **fields)
        except (KeyError, TypeError) as e:
            raise SchemaError(
                f"weights message: expected the fields of Published (its transport as format), got {sorted(message)}"
            ) from e


def _digest_of_header(tensor: torch.Tensor) -> "xxhash.xxh3_128":
    return xxhash.xxh3_128(f"{tensor.dtype}{tuple(tensor.shape)}".encode())


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """Digest of one tensor's dtype, shape and bytes."""
    digest = _digest_of_header(tensor)
    digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.digest()


# Digests are computed on a helper thread while the next tensor is copied, sent or received (xxhash
# releases the GIL), so a version's checksum costs next to nothing on top of moving it.
_digester = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshy-weights-digest")


def digest_later(tensor: torch.Tensor) -> Future:
    """tensor_digest(tensor), computed on the digest thread: `tensor` must not change until it is done."""
    return _digester.submit(tensor_digest, tensor)


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


def read_published(published: Published, held_base: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, name -> tensor) of a version, after verifying its checksum.

    An adapter version's tensors are its adapters (PEFT names) and its base's HF-named tensors, read from where
    the base is kept (`<root>/base` beside a directory; its own buckets in shared memory) and verified against
    Adapter.base, unless `held_base` is that checksum: the reader holds the base already."""
    if published.transport is Transport.DISK:
        with _corrupt_if_unreadable(published):
            if published.adapter is not None:
                return _read_adapter_directory(published, held_base)
            directory = HFDirectory.open(published.location)
            tensors = dict(directory.tensors())
            check_checksum(published, tensors_checksum(tensors))
            return directory.config(), tensors  # config.json is not covered by the checksum
    if published.transport is Transport.SHARED_MEMORY:
        return _read_shared_memory(published, held_base)
    raise SchemaError(
        f"weights v{published.version}: {published.transport} versions are not read but received on the "
        "weight-sync group (meshy.dataplane.weight_sync)"
    )


def base_directory(published: Published) -> Path:
    """Where a disk adapter version's base is kept: `<root>/base`, beside the version's directory."""
    return Path(published.location).parent / BASE


def verify_published(
    published: Published, held_base: str | None = None
) -> tuple[HFDirectory, dict, dict[str, tuple[int, ...]]]:
    """A published directory's (directory, config.json, tensor shapes), after checking its tensors against
    the announced checksum. Holds one tensor at a time (read_published holds the whole model).

    For an adapter version: its base's (directory, config.json, tensor shapes), after checking the adapters
    against the version's checksum and the base against Adapter.base (unless `held_base` is that checksum)."""
    if published.transport is not Transport.DISK:
        raise SchemaError(f"weights v{published.version}: {published.transport} version: expected a directory")
    with _corrupt_if_unreadable(published):
        if published.adapter is None:
            directory = HFDirectory.open(published.location)
            checksum, shapes = directory_checksum(directory.tensors())
            check_checksum(published, checksum)
            return directory, directory.config(), shapes
        adapters = AdapterDirectory.open(published.location)
        _check_adapter_config(published, adapters.config())
        check_checksum(published, directory_checksum(adapters.tensors())[0])
        base = HFDirectory.open(base_directory(published))
        if held_base == published.adapter.base:
            return base, base.config(), base.shapes()
        checksum, shapes = directory_checksum(base.tensors())
        check_base(published, checksum)
        return base, base.config(), shapes


def directory_checksum(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(checksum, shapes) of tensors read one at a time (none is held past its digest)."""
    digests, shapes = {}, {}
    for name, tensor in tensors:
        digests[name], shapes[name] = tensor_digest(tensor), tuple(tensor.shape)
    return combine_digests(digests), shapes


def _read_adapter_directory(published: Published, held_base: str | None) -> tuple[dict, dict[str, torch.Tensor]]:
    adapters = AdapterDirectory.open(published.location)
    _check_adapter_config(published, adapters.config())
    tensors = dict(adapters.tensors())
    check_checksum(published, tensors_checksum(tensors))
    base = HFDirectory.open(base_directory(published))
    if held_base != published.adapter.base:
        base_tensors = dict(base.tensors())
        check_base(published, tensors_checksum(base_tensors))
        tensors = {**base_tensors, **tensors}
    return base.config(), tensors


def _check_adapter_config(published: Published, config: dict) -> None:
    """The adapter_config.json a PEFT user loads (outside the checksum) must say what the version announced."""
    expected = published.adapter.peft_config("")
    for key in ("r", "lora_alpha", "target_modules"):
        if config.get(key) != expected[key]:
            raise CorruptWeights(
                f"weights v{published.version} at {published.location}: {ADAPTER_CONFIG} has {key} "
                f"{config.get(key)!r}, the announcement {expected[key]!r}"
            )


def check_base(published: Published, checksum: str) -> None:
    """CorruptWeights unless `checksum` (of the base's tensors as read) is the announced Adapter.base."""
    if checksum != published.adapter.base:
        where = (
            f"at {base_directory(published)}" if published.transport is Transport.DISK else f"({published.transport})"
        )
        raise CorruptWeights(
            f"weights v{published.version}: its base {where}: checksum mismatch (announced: {published.adapter.base})"
        )


def check_held_base(published: Published, held_base: str | None) -> None:
    """CorruptWeights naming both bases unless the reader holds the base an adapter-only version applies onto."""
    if held_base != published.adapter.base:
        raise CorruptWeights(
            f"weights v{published.version}: adapters on base {published.adapter.base}, and this engine holds "
            f"{'no base' if held_base is None else f'base {held_base}'}; it needs a version that carries the base"
        )


@contextlib.contextmanager
def _corrupt_if_unreadable(published: Published) -> Iterator[None]:
    """A published directory that cannot be read is a corrupt version (it was complete when announced)."""
    try:
        yield
    except SchemaError as e:
        raise CorruptWeights(f"weights v{published.version}: {e}") from None


def check_checksum(published: Published, checksum: str) -> None:
    """CorruptWeights unless `checksum` is the one `published` announced."""
    if checksum != published.checksum:
        where = f"at {published.location}" if published.transport is Transport.DISK else f"({published.transport})"
        raise CorruptWeights(f"weights v{published.version} {where}: checksum mismatch")


TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]  # (name, dtype, shape) of a tensor to place in a bucket


def _aligned(offset: int, itemsize: int) -> int:
    """The first offset >= `offset` at which an item of `itemsize` bytes can be viewed in place."""
    return -(-offset // itemsize) * itemsize


@dataclass(frozen=True)
class BucketLayout:
    """Where each tensor of a version lies in its buckets (flat byte buffers): bucket name -> size, and a
    manifest entry per tensor (name, dtype, shape, bucket, offset, nbytes). A model's layout is the same
    for every version, so a publisher or engine plans it once and fills the same buffers every time
    (memory already touched fills several times faster than fresh pages)."""

    sizes: dict[str, int]
    manifest: list[dict]

    @classmethod
    def plan(cls, specs: Iterable[TensorSpec], bucket_bytes: int, prefix: str = "b") -> "BucketLayout":
        """Tensors in order, in buckets `{prefix}0`, `{prefix}1`, ... of at most `bucket_bytes` (a larger
        tensor goes alone), each at an offset its dtype can be viewed at."""
        sizes: dict[str, int] = {}
        manifest, bucket, offset = [], f"{prefix}0", 0
        for name, dtype, shape in specs:
            itemsize = dtype.itemsize
            nbytes = math.prod(shape) * itemsize
            if offset and _aligned(offset, itemsize) + nbytes > bucket_bytes:
                sizes[bucket] = offset
                bucket, offset = f"{prefix}{len(sizes)}", 0
            offset = _aligned(offset, itemsize)
            manifest.append(
                {
                    "name": name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": list(shape),
                    "bucket": bucket,
                    "offset": offset,
                    "nbytes": nbytes,
                }
            )
            offset += nbytes
        sizes[bucket] = offset
        return cls(sizes, manifest)

    @classmethod
    def of(cls, meta: dict) -> "BucketLayout":
        """The layout an announcement's JSON describes."""
        return cls(meta["buckets"], meta["tensors"])

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {entry["name"]: tuple(entry["shape"]) for entry in self.manifest}

    def allocate(self) -> dict[str, torch.Tensor]:
        return {name: torch.empty(max(size, 1), dtype=torch.uint8, device=HOST) for name, size in self.sizes.items()}

    def pack(self, buffers: Mapping[str, torch.Tensor], tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy `tensors` into their places in `buffers` (a tensor not in the layout is an error)."""
        views = unpack_buckets(self.manifest, buffers, copy=False)
        for name, tensor in tensors:
            view = _view_for(views, name, tensor)
            view.copy_(_on_host_device(tensor, view))


def _view_for(views: Mapping[str, torch.Tensor], name: str, tensor: torch.Tensor) -> torch.Tensor:
    view = views.get(name)
    if view is None or view.shape != tensor.shape:
        raise SchemaError(
            f"weights tensor {name!r}: shape {tuple(tensor.shape)} is not in the buckets' layout "
            f"({'absent' if view is None else tuple(view.shape)})"
        )
    return view


def _on_host_device(tensor: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """`tensor` as it is copied into `view`: converted on its own device first when it lives elsewhere, so
    a GPU tensor crosses to the host already converted."""
    return tensor if tensor.device == view.device else tensor.to(view.dtype)


_CHUNK_BYTES = 1 << 19  # converted, then hashed while still in the CPU's cache


def place_and_digest(views: Mapping[str, torch.Tensor], name: str, tensor: torch.Tensor) -> bytes:
    """Copy `tensor` into its view in a bucket, converted to the view's dtype, chunk by chunk, hashing each
    chunk while it is still in cache (hashing it from memory afterwards costs another full read); the
    view's tensor_digest. A tensor not in the layout is an error."""
    view = _view_for(views, name, tensor)
    flat_view, flat_source = view.view(-1), _on_host_device(tensor, view).reshape(-1)
    digest, step = _digest_of_header(view), max(1, _CHUNK_BYTES // view.element_size())
    for start in range(0, flat_view.numel(), step):
        chunk = flat_view[start : start + step]
        chunk.copy_(flat_source[start : start + step])
        digest.update(chunk.view(torch.uint8).numpy())
    return digest.digest()


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


def _read_shared_memory(published: Published, held_base: str | None) -> tuple[dict, dict[str, torch.Tensor]]:
    meta = json.loads(published.location)
    tensors = _read_buckets(published, meta)
    check_checksum(published, tensors_checksum(tensors))
    if published.adapter is not None and held_base != published.adapter.base:
        if "base" not in meta:
            raise CorruptWeights(f"weights v{published.version}: an adapter version whose location has no base")
        base = _read_buckets(published, meta["base"])
        check_base(published, tensors_checksum(base))
        tensors = {**base, **tensors}
    return meta["config"], tensors


def _read_buckets(published: Published, meta: dict) -> dict[str, torch.Tensor]:
    """Copies of the tensors `meta` (its buckets' sizes and manifest) lays out in shared memory."""
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
            return unpack_buckets(meta["tensors"], buffers)
        finally:
            del buffers  # no view of a bucket may outlive it (buckets get unlinked)
    finally:
        for shm in buckets.values():
            shm.close()
