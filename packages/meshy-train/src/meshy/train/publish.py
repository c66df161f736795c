"""Publishing trained weights: each version as a Hugging Face directory, as shared-memory buckets, or as
buckets broadcast to the engines on the weight-sync group (meshy.dataplane.weight_sync); and every n-th
version kept as an HF directory whatever the transport (KeepingPublisher).

Every publisher gathers the model tensor by tensor (a DTensor's `full_tensor` is a collective every
rank joins; only rank 0 keeps the result), so no rank ever holds a second copy of the whole model. Rank
0 writes, then announces the version on the data plane's `weights` stream (meshy.dataplane.weights
defines the message and the verified reader): WeightsPublisher does that for every transport, and each
transport's subclass only writes (and, once announced, prunes, unlinks or broadcasts).

A model with adapters (meshy.train.lora) is published as LoRA versions (meshy.dataplane.adapters): its frozen
base once, kept where the transport keeps it (`root/base` on disk, buckets of its own in shared memory, rank
0's buffers for the collective, sent with the first version and with one an engine asks for whole), and each
version's adapters under PEFT's names. A publisher made with `adapters=False` publishes such a model whole, its
adapters merged into the base, for whoever needs whole weights (the reference, a merged final model).
"""

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing import shared_memory
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from meshy.dataplane import DataPlaneClient, SchemaError, weight_delta
from meshy.dataplane.adapters import Adapter, adapter_names
from meshy.dataplane.hf_directory import ADAPTER_CONFIG, ADAPTER_WEIGHTS, HFDirectory
from meshy.dataplane.weight_sync import WeightSyncGroup
from meshy.dataplane.weights import (
    BASE,
    DTYPES,
    WEIGHTS_STREAM,
    BucketLayout,
    Published,
    TensorSpec,
    Transport,
    base_directory,
    combine_digests,
    digest_later,
    directory_checksum,
    place_and_digest,
    resync_stream,
    tensors_checksum,
    unpack_buckets,
)
from meshy.train.lora import adapter_tensors, base_names, base_tensors, lora_config_of, merged_tensors
from meshy.train.models import DecoderArch
from meshy.train.titan_models import state_dict_adapter
from meshy.train.training_config import LoraConfig

log = logging.getLogger(__name__)


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def full_hf_tensors(model: torch.nn.Module, arch: DecoderArch) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor where the model keeps it, in its dtype) pairs gathered one at a time: the whole
    model, and for a model with adapters the whole model they make (each merged into its base weight, W +
    scale B A: meshy.train.lora.merged_tensors), never the adapters' own names. Every rank must iterate;
    only rank 0 gets data."""
    yield from _to_hf(merged_tensors(model), arch)


def base_hf_tensors(model: torch.nn.Module, arch: DecoderArch) -> Iterator[tuple[str, torch.Tensor]]:
    """A model's frozen base (the whole model, without adapters) as full_hf_tensors gathers it, under the same
    HF names: what an adapter version applies onto. Every rank must iterate; only rank 0 gets data."""
    yield from _to_hf(base_tensors(model), arch)


def _to_hf(tensors: Iterator[tuple[str, torch.Tensor]], arch: DecoderArch) -> Iterator[tuple[str, torch.Tensor]]:
    adapter = state_dict_adapter(arch)
    for name, full in tensors:
        yield from adapter.to_hf({name: full}).items()


def hf_tensors(model: torch.nn.Module, arch: DecoderArch, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """full_hf_tensors in `dtype` on the host."""
    return _converted(full_hf_tensors(model, arch), dtype)


def _converted(tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        yield name, tensor.to(dtype).cpu().contiguous()  # converted where it lives (GPU: on device)


def hf_specs(model: torch.nn.Module, arch: DecoderArch, dtype: torch.dtype) -> list[TensorSpec]:
    """(HF name, `dtype`, shape) of every tensor full_hf_tensors (and base_hf_tensors) yields, in order,
    without moving data."""
    state = model.state_dict()
    shapes = {unadapted: torch.empty(state[name].shape, device="meta") for unadapted, name in base_names(model).items()}
    return [(name, dtype, tuple(t.shape)) for name, t in state_dict_adapter(arch).to_hf(shapes).items()]


def adapter_specs(model: torch.nn.Module, arch: DecoderArch, dtype: torch.dtype) -> list[TensorSpec]:
    """(PEFT name, `dtype`, shape) of every tensor meshy.train.lora.adapter_tensors yields, in order, without
    moving data."""
    to_hf = state_dict_adapter(arch).to_hf
    specs = []
    for name, value in model.state_dict().items():
        for half, suffix in enumerate((".lora_A.weight", ".lora_B.weight")):
            if name.endswith(suffix):
                (hf_name,) = to_hf({name.removesuffix(suffix) + ".weight": torch.empty(0, device="meta")})
                specs.append((adapter_names(hf_name)[half], dtype, tuple(value.shape)))
    return specs


def pack_version(
    layout: BucketLayout, buffers: dict[str, torch.Tensor], tensors: Iterator[tuple[str, torch.Tensor]], what: str
) -> str:
    """Convert `tensors` (full_hf_tensors) into their places in `buffers`, hashing each chunk as it is
    copied; the version's checksum."""
    return combine_digests(pack_digests(layout, buffers, tensors, what))


def pack_digests(
    layout: BucketLayout, buffers: dict[str, torch.Tensor], tensors: Iterator[tuple[str, torch.Tensor]], what: str
) -> dict[str, bytes]:
    """pack_version, with each tensor's digest rather than their checksum."""
    views = unpack_buckets(layout.manifest, buffers, copy=False)
    digests = {name: place_and_digest(views, name, tensor) for name, tensor in tensors}
    if digests.keys() != views.keys():
        raise SchemaError(f"{what}: the model lacks tensors of the layout: {sorted(views.keys() - digests.keys())[:3]}")
    return digests


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise SchemaError(f"publish dtype: expected one of {list(DTYPES)}, got {dtype!r}")


def _check_keep(keep: int) -> None:
    if keep < 1:
        raise SchemaError(f"publish keep: expected >= 1 versions, got {keep}")


class WeightsPublisher:
    """What publishing a version does whatever the transport: every rank joins the gather, rank 0 writes
    the version the transport's way (`_write`), times it, announces it on `stream` and finishes
    (`_after_announcing`: what the transport does once engines know of the version).

    adapters: a model with adapters goes as LoRA versions, its base kept once (`_keep_base`, at its first
    version) and each version its adapters; False: as whole versions, the adapters merged."""

    transport: Transport

    def __init__(
        self, arch: DecoderArch, client: DataPlaneClient | None, dtype: str, stream: str, adapters: bool = True
    ):
        _check_dtype(dtype)
        self.arch = arch
        self.client = client
        self.dtype = dtype
        self.stream = stream
        self.adapters = adapters
        self._base_kept = False  # every rank: whether the base was gathered and kept
        self._adapter: Adapter | None = None  # what rank 0 announces LoRA versions with, once the base is kept

    def publish(self, model: torch.nn.Module, version: int) -> Published | None:
        """Every rank calls this (the gather is a collective); rank 0 writes, announces and returns what it
        announced."""
        start = time.perf_counter()
        lora = lora_config_of(model) if self.adapters else None
        if lora is not None and not self._base_kept:
            if _is_writer():
                self._adapter = self._lora_adapter(model, lora, self._keep_base(model))
            else:
                _drain(base_hf_tensors(model, self.arch))
            self._base_kept = True
        if not _is_writer():
            _drain(self._gathered(model, lora is not None))
            return None
        adapter = None if lora is None else self._adapter
        location, checksum, num_bytes = self._write(model, version, adapter)
        elapsed = time.perf_counter() - start
        published = Published(version, self.transport, location, checksum, num_bytes, elapsed, adapter=adapter)
        self._announce(published)
        self._after_announcing(published)
        return published

    def _lora_adapter(self, model: torch.nn.Module, lora: LoraConfig, base: str) -> Adapter:
        """What LoRA versions of `model` on the base of checksum `base` are announced with."""
        modules = {name.split(".")[-3] for name, _, _ in adapter_specs(model, self.arch, DTYPES[self.dtype])}
        return Adapter(lora.rank, float(lora.alpha), tuple(sorted(modules)), base)

    def _gathered(self, model: torch.nn.Module, adapters: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """A version's tensors, gathered: the adapters (PEFT names) of a LoRA version, or the whole model."""
        return adapter_tensors(model) if adapters else full_hf_tensors(model, self.arch)

    def _specs(self, model: torch.nn.Module, adapters: bool) -> list[TensorSpec]:
        """What _gathered yields, in the published dtype, without moving data."""
        dtype = DTYPES[self.dtype]
        return adapter_specs(model, self.arch, dtype) if adapters else hf_specs(model, self.arch, dtype)

    def _keep_base(self, model: torch.nn.Module) -> str:
        """Rank 0: gather the base (base_hf_tensors) and keep it where LoRA versions' readers find it; its
        checksum in the published dtype."""
        raise NotImplementedError

    def _write(self, model: torch.nn.Module, version: int, adapter: Adapter | None) -> tuple[str, str, int]:
        """Rank 0: gather and write the version (its adapters, when `adapter` is set); its (location,
        checksum, num_bytes)."""
        raise NotImplementedError

    def _after_announcing(self, published: Published) -> None:
        """Rank 0, once the version is announced."""

    def _announce(self, published: Published) -> None:
        if self.client is not None:
            self.client.append(self.stream, published.to_message())

    def _buckets_location(self, layout: BucketLayout, **more: object) -> str:
        """A bucketed version's location: its config.json, the buckets' sizes, the tensors' manifest and
        what the transport adds."""
        meta = {"config": self.arch.hf_config(self.dtype), "buckets": layout.sizes, "tensors": layout.manifest}
        return json.dumps({**meta, **more})


def _drain(tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Join every gather of `tensors` (on ranks other than 0, which get nothing)."""
    for _ in tensors:
        pass


class DirectoryPublisher(WeightsPublisher):
    """Writes version v to `root/v{v:06d}`: config.json, model.safetensors (or shards and an index).
    The directory is built under a temporary name and renamed into place, so no reader ever sees half a
    version (a process crash leaves only the temporary; torn writes after power loss fail the checksum).

    A LoRA version's directory is a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)
    on the base written once as the HF directory `root/base` (kept as it is when it already holds the same
    tensors, so versions written before still apply; never pruned): `peft.PeftModel.from_pretrained` loads
    the version onto `transformers`' model of the base."""

    transport = Transport.DISK

    def __init__(
        self,
        root: str | Path,
        arch: DecoderArch,
        client: DataPlaneClient | None = None,
        dtype: str = "bfloat16",
        max_shard_bytes: int = 4 << 30,
        keep: int = 2,
        stream: str = WEIGHTS_STREAM,
        adapters: bool = True,
    ):
        super().__init__(arch, client, dtype, stream, adapters)
        _check_keep(keep)
        self.root = Path(root)
        self.max_shard_bytes = max_shard_bytes
        self.keep = keep
        self._linked_base: str | None = None  # the base of the LoRA versions `link` kept, once linked here

    def link(self, published: Published) -> None:
        """Keep a version another DirectoryPublisher wrote as hard links to its files under this root, and
        announce it (rank 0). A LoRA version's base is linked too, as this root's base, once."""
        kept = self._directory(published.version)
        if published.adapter is None:
            shutil.copytree(published.location, kept, copy_function=os.link)
        else:
            self._link_base(published)
            tmp = self._temporary(kept.name)
            os.link(Path(published.location) / ADAPTER_WEIGHTS, tmp / ADAPTER_WEIGHTS)
            self._write_adapter_config(tmp, published.adapter)
            os.rename(tmp, kept)
        self._announce(replace(published, location=str(kept)))

    def _link_base(self, published: Published) -> None:
        if self._linked_base == published.adapter.base:
            return
        base = self.root / BASE
        if not _holds(base, published.adapter.base):
            tmp = self._temporary(BASE)
            shutil.copytree(base_directory(published), tmp, copy_function=os.link, dirs_exist_ok=True)
            _swap_in(tmp, base)
        self._linked_base = published.adapter.base

    def _directory(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def _temporary(self, name: str) -> Path:
        """An empty directory to build `root/name` in, renamed into place once complete."""
        tmp = self.root / f".{name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def _keep_base(self, model: torch.nn.Module) -> str:
        tmp = self._temporary(BASE)
        checksum, _ = self._write_model(tmp, base_hf_tensors(model, self.arch))
        base = self.root / BASE
        if _holds(base, checksum):  # as a resumed run finds it: versions written before apply onto it
            shutil.rmtree(tmp)
        else:
            _swap_in(tmp, base)
        return checksum

    def _write(self, model: torch.nn.Module, version: int, adapter: Adapter | None) -> tuple[str, str, int]:
        final = self._directory(version)
        if final.exists():
            raise SchemaError(f"weights version {version} already exists at {final}")
        tmp = self._temporary(final.name)
        if adapter is None:
            checksum, num_bytes = self._write_model(tmp, full_hf_tensors(model, self.arch))
        else:
            checksum, num_bytes = self._write_adapters(tmp, adapter_tensors(model), adapter)
        os.rename(tmp, final)
        return str(final), checksum, num_bytes

    def _write_model(self, directory: Path, tensors: Iterator[tuple[str, torch.Tensor]]) -> tuple[str, int]:
        """Write gathered HF-named tensors into `directory` as an HF model directory; (checksum, bytes)."""
        shard: dict[str, torch.Tensor] = {}
        shard_bytes, weight_map, files, digests = 0, {}, [], {}
        for name, tensor in _converted(tensors, DTYPES[self.dtype]):
            digests[name] = digest_later(tensor)  # hashed while shards are written
            size = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + size > self.max_shard_bytes:
                files.append(self._write_shard(directory, len(files), shard))
                shard, shard_bytes = {}, 0
            shard[name] = tensor
            weight_map[name] = len(files)
            shard_bytes += size
        files.append(self._write_shard(directory, len(files), shard))
        names = (
            ["model.safetensors"]
            if len(files) == 1
            else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
        )
        for file, name in zip(files, names, strict=True):
            (directory / file).rename(directory / name)
        num_bytes = sum((directory / n).stat().st_size for n in names)
        if len(names) > 1:
            index = {"metadata": {"total_size": num_bytes}, "weight_map": {k: names[i] for k, i in weight_map.items()}}
            (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        (directory / "config.json").write_text(json.dumps(self.arch.hf_config(self.dtype), indent=1))
        return combine_digests({name: digest.result() for name, digest in digests.items()}), num_bytes

    def _write_adapters(
        self, directory: Path, tensors: Iterator[tuple[str, torch.Tensor]], adapter: Adapter
    ) -> tuple[str, int]:
        """Write gathered adapters into `directory` as a PEFT adapter directory; (checksum, bytes)."""
        state = dict(_converted(tensors, DTYPES[self.dtype]))
        save_file(state, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        self._write_adapter_config(directory, adapter)
        return tensors_checksum(state), (directory / ADAPTER_WEIGHTS).stat().st_size

    def _write_adapter_config(self, directory: Path, adapter: Adapter) -> None:
        config = adapter.peft_config(str((self.root / BASE).absolute()))
        (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    @staticmethod
    def _write_shard(directory: Path, i: int, tensors: dict[str, torch.Tensor]) -> str:
        name = f".shard{i}.safetensors"
        save_file(tensors, directory / name, metadata={"format": "pt"})
        return name

    def _after_announcing(self, published: Published) -> None:
        """Keep the newest `keep` versions (readers load the latest one announced); the base stays."""
        for old in self.root.glob("v[0-9]*"):
            if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) <= published.version - self.keep:
                shutil.rmtree(old, ignore_errors=True)


def _holds(base: Path, checksum: str) -> bool:
    """Whether the HF directory `base` holds tensors of checksum `checksum` (read one at a time)."""
    try:
        return directory_checksum(HFDirectory.open(base).tensors())[0] == checksum
    except SchemaError:  # absent, or unreadable: written again
        return False


def _swap_in(tmp: Path, directory: Path) -> None:
    """Put the complete directory `tmp` in the place of `directory`, which may exist (and is then removed)."""
    old = directory.with_name(f".{directory.name}.old{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        os.rename(directory, old)
    os.rename(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)


class SharedMemoryPublisher(WeightsPublisher):
    """Same-host path: a version's tensors packed into POSIX shared-memory buckets, with a manifest of
    (name, dtype, shape, bucket, offset) in the announcement. Nothing touches disk.

    A LoRA version's buckets hold its adapters; the base is packed once into buckets of its own, kept until
    close and described under "base" in every version's location."""

    transport = Transport.SHARED_MEMORY

    def __init__(
        self,
        prefix: str,
        arch: DecoderArch,
        client: DataPlaneClient | None = None,
        dtype: str = "bfloat16",
        bucket_bytes: int = 512 << 20,
        keep: int = 2,
        stream: str = WEIGHTS_STREAM,
        adapters: bool = True,
    ):
        super().__init__(arch, client, dtype, stream, adapters)
        _check_keep(keep)
        self.prefix = prefix
        self.bucket_bytes = bucket_bytes
        self.keep = keep
        self._versions: dict[int, list[shared_memory.SharedMemory]] = {}
        self._base: list[shared_memory.SharedMemory] = []
        self._base_layout: BucketLayout | None = None

    def _keep_base(self, model: torch.nn.Module) -> str:
        specs = hf_specs(model, self.arch, DTYPES[self.dtype])
        layout = BucketLayout.plan(specs, self.bucket_bytes, prefix=f"{self.prefix}-base-b")
        self._base, checksum = _pack_shared(
            layout, base_hf_tensors(model, self.arch), "shared-memory publishing the base"
        )
        self._base_layout = layout
        return checksum

    def _write(self, model: torch.nn.Module, version: int, adapter: Adapter | None) -> tuple[str, str, int]:
        adapters = adapter is not None
        layout = BucketLayout.plan(
            self._specs(model, adapters), self.bucket_bytes, prefix=f"{self.prefix}-v{version}-b"
        )
        tensors = self._gathered(model, adapters)
        self._versions[version], checksum = _pack_shared(layout, tensors, f"shared-memory publishing v{version}")
        more = {"base": {"buckets": self._base_layout.sizes, "tensors": self._base_layout.manifest}} if adapters else {}
        return self._buckets_location(layout, **more), checksum, sum(layout.sizes.values())

    def _after_announcing(self, published: Published) -> None:
        """Unlink the versions older than the newest `keep`."""
        for old in [v for v in self._versions if v <= published.version - self.keep]:
            _unlink(self._versions.pop(old))

    def close(self) -> None:
        """Unlink every version still held, and the base (readers must have loaded them)."""
        for version in list(self._versions):
            _unlink(self._versions.pop(version))
        _unlink(self._base)
        self._base = []


def _pack_shared(
    layout: BucketLayout, tensors: Iterator[tuple[str, torch.Tensor]], what: str
) -> tuple[list[shared_memory.SharedMemory], str]:
    """New shared-memory buckets of `layout`, holding `tensors` (pack_version); (buckets, checksum)."""
    buckets = {
        name: shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
        for name, size in layout.sizes.items()
    }
    try:
        buffers = {
            name: torch.frombuffer(shm.buf, dtype=torch.uint8, count=max(layout.sizes[name], 1))
            for name, shm in buckets.items()
        }
        checksum = pack_version(layout, buffers, tensors, what)
        del buffers  # no view may outlive the mappings
    except BaseException:
        for shm in buckets.values():
            shm.unlink()  # freed once the last view of it is gone
            with contextlib.suppress(BufferError):
                shm.close()
        raise
    return list(buckets.values()), checksum


def _unlink(buckets: list[shared_memory.SharedMemory]) -> None:
    for shm in buckets:
        shm.close()
        shm.unlink()


class CollectivePublisher(WeightsPublisher):
    """Version v as buckets that training rank 0 broadcasts to every engine on the weight-sync group, after
    announcing it (config, bucket layout, checksum) on the `weights` stream so the engines join. Nothing
    touches disk. Rank 0 plans the buckets once and converts every version straight into the same
    buffers, hashing each tensor on a helper thread meanwhile.

    delta: send what changed since the previous version (meshy.dataplane.weight_delta), a whole version
    every `full_every`-th one and whenever an engine asked for one on the resync stream (it could not
    rebuild a delta). The buffers hold the previous version, and comparing each tensor with it advances
    them to this one, so rank 0 still holds one copy of the model.

    A LoRA version is its adapters (a delta of them, with delta), and carries the base too when it is the
    first and when an engine asked for a whole version: rank 0 keeps the base packed in buffers of its own
    (bucket names base-b0, ...), so sending it again gathers nothing."""

    transport = Transport.COLLECTIVE

    def __init__(
        self,
        group: WeightSyncGroup | None,
        arch: DecoderArch,
        client: DataPlaneClient | None = None,
        dtype: str = "bfloat16",
        bucket_bytes: int = 512 << 20,
        stream: str = WEIGHTS_STREAM,
        delta: bool = False,
        full_every: int = 10,
        adapters: bool = True,
    ):
        super().__init__(arch, client, dtype, stream, adapters)
        if bucket_bytes < 1 or full_every < 1:
            raise SchemaError(
                f"collective publishing: bucket_bytes and full_every >= 1, got {bucket_bytes}, {full_every}"
            )
        if group is None and _is_writer():
            raise SchemaError("collective publishing: training rank 0 needs the weight-sync group")
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.delta = delta
        self.full_every = full_every
        self._layout: BucketLayout | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # the last version packed (rank 0)
        self._held: int | None = None  # the version _buffers hold intact, the next delta's base
        self._since_full = 0
        self._sending: dict[str, torch.Tensor] = {}  # the buckets of the version being published (rank 0)
        self._base_layout: BucketLayout | None = None  # a LoRA model's base, packed once (rank 0)
        self._base_buffers: dict[str, torch.Tensor] = {}
        self._base_digests: dict[str, bytes] = {}
        self._base_sent = False
        self._resync = None  # engines' requests for a whole version (delta only; rank 0 only)
        if client is not None and _is_writer() and (delta or adapters):
            self._resync = client.reader(resync_stream(stream), "collective-publisher", start="latest")

    def _keep_base(self, model: torch.nn.Module) -> str:
        self._base_layout = BucketLayout.plan(
            hf_specs(model, self.arch, DTYPES[self.dtype]), self.bucket_bytes, "base-b"
        )
        self._base_buffers = self._base_layout.allocate()
        tensors = base_hf_tensors(model, self.arch)
        self._base_digests = pack_digests(
            self._base_layout, self._base_buffers, tensors, "collective publishing the base"
        )
        return combine_digests(self._base_digests)

    def _write(self, model: torch.nn.Module, version: int, adapter: Adapter | None) -> tuple[str, str, int]:
        """Pack the version (or its delta) into the buckets broadcast once it is announced."""
        adapters = adapter is not None
        if self._layout is None:
            self._layout = BucketLayout.plan(self._specs(model, adapters), self.bucket_bytes)
            self._buffers = self._layout.allocate()
        asked = self._asked()  # read every version, so a request is answered once, not again after a whole one
        base, self._held = self._held, None  # the buffers change: they hold a version again once it is packed
        if self.delta and base is not None and self._since_full < self.full_every - 1 and not asked:
            layout, self._sending, checksum, delta = self._encode(model, base, adapters)
        else:
            layout, self._sending, delta = self._layout, self._buffers, None
            tensors = self._gathered(model, adapters)
            digests = pack_digests(layout, self._sending, tensors, f"collective publishing v{version}")
            if adapters and (asked or not self._base_sent):
                layout, self._sending, digests = self._with_base(layout, digests)
                self._base_sent = True
            checksum = combine_digests(digests)
        self._held = version
        self._since_full = 0 if delta is None else self._since_full + 1
        more: dict[str, object] = {}
        if delta is not None:
            more["delta"] = delta
        if self.group.rendezvous is not None:  # engines that join the group themselves learn where here
            more["rendezvous"] = self.group.rendezvous
        return self._buckets_location(layout, **more), checksum, sum(layout.sizes.values())

    def _with_base(
        self, layout: BucketLayout, digests: dict[str, bytes]
    ) -> tuple[BucketLayout, dict[str, torch.Tensor], dict[str, bytes]]:
        """An adapter version's (layout, buffers, digests) with the base's buckets first."""
        base = self._base_layout
        both = BucketLayout({**base.sizes, **layout.sizes}, [*base.manifest, *layout.manifest])
        return both, {**self._base_buffers, **self._buffers}, {**self._base_digests, **digests}

    def _after_announcing(self, published: Published) -> None:
        """Broadcast the version to the engines, which joined on its announcement."""
        sending, self._sending = self._sending, {}
        self.group.send(published, sending)

    def _encode(
        self, model: torch.nn.Module, base: int, adapters: bool
    ) -> tuple[BucketLayout, dict[str, torch.Tensor], str, dict]:
        """(layout, buffers, checksum, delta description) of the delta from version `base`, which the
        buffers hold, to `model`'s weights (its adapters, for a LoRA version); the buffers hold those
        weights afterwards."""
        digests = {}

        def hashed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in _converted(self._gathered(model, adapters), DTYPES[self.dtype]):
                digests[name] = digest_later(tensor)  # hashed while the next tensor is compared
                yield name, tensor

        held = unpack_buckets(self._layout.manifest, self._buffers, copy=False)
        segments, delta = weight_delta.encode(hashed(), held)
        delta["base"] = base
        layout = BucketLayout.plan([(name, t.dtype, tuple(t.shape)) for name, t in segments], self.bucket_bytes)
        sent = layout.allocate()
        layout.pack(sent, segments)
        return layout, sent, combine_digests({name: digest.result() for name, digest in digests.items()}), delta

    def _asked(self) -> bool:
        """Whether an engine asked for a whole version since the last one (every request is read)."""
        if self._resync is None:
            return False
        asked = self._resync.read(max_n=4096)
        for message in asked:
            payload = message.payload
            log.warning("weights: %s asked for a whole version (%s)", payload["engine"], payload["error"])
        return bool(asked)


class KeepingPublisher:
    """Another publisher's versions, every `every`-th one (version 0 included) and version `last` also kept
    as an HF directory `root/v{v:06d}` in `dtype`, whatever the transport: shared-memory and broadcast
    versions vanish with the run, and disk keeps only the newest few. A disk version is kept as hard links
    to the files already written; others are written (every rank calls publish: the gather is a
    collective). With a client, each kept version is announced on `stream` (its reader owns the copy).
    LoRA versions (the publisher's `adapters`) are kept as PEFT adapter directories on `root/base`."""

    def __init__(
        self,
        publisher: "WeightsPublisher | KeepingPublisher",
        every: int,
        root: str | Path,
        arch: DecoderArch,
        dtype: str,
        last: int | None = None,
        client: DataPlaneClient | None = None,
        stream: str = WEIGHTS_STREAM,
    ):
        if every < 1:
            raise SchemaError(f"hf_every: expected versions >= 1 between kept versions, got {every}")
        self.publisher = publisher
        self.every = every
        self.last = last
        inner = publisher
        while isinstance(inner, KeepingPublisher):
            inner = inner.publisher
        self._writer = DirectoryPublisher(
            root, arch, client, dtype=dtype, keep=1 << 62, stream=stream, adapters=inner.adapters
        )
        self._links = isinstance(inner, DirectoryPublisher)  # the same on every rank

    def publish(self, model: torch.nn.Module, version: int) -> Published | None:
        published = self.publisher.publish(model, version)
        if version % self.every and version != self.last:
            return published
        if not self._links:
            self._writer.publish(model, version)  # written and announced by rank 0
        elif published is not None:  # rank 0
            self._writer.link(published)
        return published
