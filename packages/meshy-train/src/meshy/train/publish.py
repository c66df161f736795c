"""Publishing trained weights: each version as a Hugging Face directory, as shared-memory buckets, or as
buckets broadcast to the engines on the weight-sync group (meshy.dataplane.weight_sync); and every n-th
version kept as an HF directory whatever the transport (KeepingPublisher).

Every publisher gathers the model tensor by tensor (a DTensor's `full_tensor` is a collective every
rank joins; only rank 0 keeps the result), so no rank ever holds a second copy of the whole model. Rank
0 writes, then announces the version on the data plane's `weights` stream (meshy.dataplane.weights
defines the message and the verified reader): WeightsPublisher does that for every transport, and each
transport's subclass only writes (and, once announced, prunes, unlinks or broadcasts).
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
from torch.distributed.tensor import DTensor

from meshy.dataplane import DataPlaneClient, SchemaError, weight_delta
from meshy.dataplane.weight_sync import WeightSyncGroup
from meshy.dataplane.weights import (
    DTYPES,
    WEIGHTS_STREAM,
    BucketLayout,
    Published,
    TensorSpec,
    Transport,
    combine_digests,
    digest_later,
    place_and_digest,
    resync_stream,
    unpack_buckets,
)
from meshy.train.models import DecoderArch
from meshy.train.titan_models import state_dict_adapter

log = logging.getLogger(__name__)


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def full_hf_tensors(model: torch.nn.Module, arch: DecoderArch) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor where the model keeps it, in its dtype) pairs gathered one at a time. Every
    rank must iterate; only rank 0 gets data."""
    adapter = state_dict_adapter(arch)
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if _is_writer():
            yield from adapter.to_hf({name: full.detach()}).items()


def hf_tensors(model: torch.nn.Module, arch: DecoderArch, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """full_hf_tensors in `dtype` on the host."""
    for name, tensor in full_hf_tensors(model, arch):
        yield name, tensor.to(dtype).cpu().contiguous()  # converted where it lives (GPU: on device)


def hf_specs(model: torch.nn.Module, arch: DecoderArch, dtype: torch.dtype) -> list[TensorSpec]:
    """(HF name, `dtype`, shape) of every tensor full_hf_tensors yields, in order, without moving data."""
    shapes = {name: torch.empty(value.shape, device="meta") for name, value in model.state_dict().items()}
    return [(name, dtype, tuple(t.shape)) for name, t in state_dict_adapter(arch).to_hf(shapes).items()]


def pack_version(
    layout: BucketLayout, buffers: dict[str, torch.Tensor], tensors: Iterator[tuple[str, torch.Tensor]], what: str
) -> str:
    """Convert `tensors` (full_hf_tensors) into their places in `buffers`, hashing each chunk as it is
    copied; the version's checksum."""
    views = unpack_buckets(layout.manifest, buffers, copy=False)
    digests = {name: place_and_digest(views, name, tensor) for name, tensor in tensors}
    if digests.keys() != views.keys():
        raise SchemaError(f"{what}: the model lacks tensors of the layout: {sorted(views.keys() - digests.keys())[:3]}")
    return combine_digests(digests)


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise SchemaError(f"publish dtype: expected one of {list(DTYPES)}, got {dtype!r}")


def _check_keep(keep: int) -> None:
    if keep < 1:
        raise SchemaError(f"publish keep: expected >= 1 versions, got {keep}")


class WeightsPublisher:
    """What publishing a version does whatever the transport: every rank joins the gather, rank 0 writes
    the version the transport's way (`_write`), times it, announces it on `stream` and finishes
    (`_after_announcing`: what the transport does once engines know of the version)."""

    transport: Transport

    def __init__(self, arch: DecoderArch, client: DataPlaneClient | None, dtype: str, stream: str):
        _check_dtype(dtype)
        self.arch = arch
        self.client = client
        self.dtype = dtype
        self.stream = stream

    def publish(self, model: torch.nn.Module, version: int) -> Published | None:
        """Every rank calls this (the gather is a collective); rank 0 writes, announces and returns what it
        announced."""
        start = time.perf_counter()
        if not _is_writer():
            list(full_hf_tensors(model, self.arch))  # joins every gather; yields nothing here
            return None
        location, checksum, num_bytes = self._write(model, version)
        published = Published(version, self.transport, location, checksum, num_bytes, time.perf_counter() - start)
        self._announce(published)
        self._after_announcing(published)
        return published

    def _write(self, model: torch.nn.Module, version: int) -> tuple[str, str, int]:
        """Rank 0: gather and write the version; its (location, checksum, num_bytes)."""
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


class DirectoryPublisher(WeightsPublisher):
    """Writes version v to `root/v{v:06d}`: config.json, model.safetensors (or shards and an index).
    The directory is built under a temporary name and renamed into place, so no reader ever sees half a
    version (a process crash leaves only the temporary; torn writes after power loss fail the checksum)."""

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
    ):
        super().__init__(arch, client, dtype, stream)
        _check_keep(keep)
        self.root = Path(root)
        self.max_shard_bytes = max_shard_bytes
        self.keep = keep

    def link(self, published: Published) -> None:
        """Keep a version another DirectoryPublisher wrote as hard links to its files under this root, and
        announce it (rank 0)."""
        kept = self._directory(published.version)
        shutil.copytree(published.location, kept, copy_function=os.link)
        self._announce(replace(published, location=str(kept)))

    def _directory(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def _write(self, model: torch.nn.Module, version: int) -> tuple[str, str, int]:
        final = self._directory(version)
        tmp = self.root / f".v{version:06d}.tmp{os.getpid()}"
        if final.exists():
            raise SchemaError(f"weights version {version} already exists at {final}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        shard: dict[str, torch.Tensor] = {}
        shard_bytes, weight_map, files, digests = 0, {}, [], {}
        for name, tensor in hf_tensors(model, self.arch, DTYPES[self.dtype]):
            digests[name] = digest_later(tensor)  # hashed while shards are written
            size = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + size > self.max_shard_bytes:
                files.append(self._write_shard(tmp, len(files), shard))
                shard, shard_bytes = {}, 0
            shard[name] = tensor
            weight_map[name] = len(files)
            shard_bytes += size
        files.append(self._write_shard(tmp, len(files), shard))
        names = (
            ["model.safetensors"]
            if len(files) == 1
            else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
        )
        for file, name in zip(files, names, strict=True):
            (tmp / file).rename(tmp / name)
        num_bytes = sum((tmp / n).stat().st_size for n in names)
        if len(names) > 1:
            index = {"metadata": {"total_size": num_bytes}, "weight_map": {k: names[i] for k, i in weight_map.items()}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        (tmp / "config.json").write_text(json.dumps(self.arch.hf_config(self.dtype), indent=1))
        checksum = combine_digests({name: digest.result() for name, digest in digests.items()})
        os.rename(tmp, final)
        return str(final), checksum, num_bytes

    @staticmethod
    def _write_shard(directory: Path, i: int, tensors: dict[str, torch.Tensor]) -> str:
        name = f".shard{i}.safetensors"
        save_file(tensors, directory / name, metadata={"format": "pt"})
        return name

    def _after_announcing(self, published: Published) -> None:
        """Keep the newest `keep` versions (readers load the latest one announced)."""
        for old in self.root.glob("v[0-9]*"):
            if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) <= published.version - self.keep:
                shutil.rmtree(old, ignore_errors=True)


class SharedMemoryPublisher(WeightsPublisher):
    """Same-host path: a version's tensors packed into POSIX shared-memory buckets, with a manifest of
    (name, dtype, shape, bucket, offset) in the announcement. Nothing touches disk."""

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
    ):
        super().__init__(arch, client, dtype, stream)
        _check_keep(keep)
        self.prefix = prefix
        self.bucket_bytes = bucket_bytes
        self.keep = keep
        self._versions: dict[int, list[shared_memory.SharedMemory]] = {}

    def _write(self, model: torch.nn.Module, version: int) -> tuple[str, str, int]:
        specs = hf_specs(model, self.arch, DTYPES[self.dtype])
        layout = BucketLayout.plan(specs, self.bucket_bytes, prefix=f"{self.prefix}-v{version}-b")
        buckets = {
            name: shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
            for name, size in layout.sizes.items()
        }
        try:
            buffers = {
                name: torch.frombuffer(shm.buf, dtype=torch.uint8, count=max(layout.sizes[name], 1))
                for name, shm in buckets.items()
            }
            tensors = full_hf_tensors(model, self.arch)
            checksum = pack_version(layout, buffers, tensors, f"shared-memory publishing v{version}")
            del buffers  # no view may outlive the mappings
        except BaseException:
            for shm in buckets.values():
                shm.unlink()  # freed once the last view of it is gone
                with contextlib.suppress(BufferError):
                    shm.close()
            raise
        self._versions[version] = list(buckets.values())
        return self._buckets_location(layout), checksum, sum(layout.sizes.values())

    def _after_announcing(self, published: Published) -> None:
        """Unlink the versions older than the newest `keep`."""
        for old in [v for v in self._versions if v <= published.version - self.keep]:
            self._unlink(old)

    def _unlink(self, version: int) -> None:
        for shm in self._versions.pop(version):
            shm.close()
            shm.unlink()

    def close(self) -> None:
        """Unlink every version still held (readers must have loaded them)."""
        for version in list(self._versions):
            self._unlink(version)


class CollectivePublisher(WeightsPublisher):
    """Version v as buckets that training rank 0 broadcasts to every engine on the weight-sync group, after
    announcing it (config, bucket layout, checksum) on the `weights` stream so the engines join. Nothing
    touches disk. Rank 0 plans the buckets once and converts every version straight into the same
    buffers, hashing each tensor on a helper thread meanwhile.

    delta: send what changed since the previous version (meshy.dataplane.weight_delta), a whole version
    every `full_every`-th one and whenever an engine asked for one on the resync stream (it could not
    rebuild a delta). The buffers hold the previous version, and comparing each tensor with it advances
    them to this one, so rank 0 still holds one copy of the model."""

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
    ):
        super().__init__(arch, client, dtype, stream)
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
        self._resync = None  # engines' requests for a whole version (delta only; rank 0 only)
        if delta and client is not None and _is_writer():
            self._resync = client.reader(resync_stream(stream), "collective-publisher", start="latest")

    def _write(self, model: torch.nn.Module, version: int) -> tuple[str, str, int]:
        """Pack the version (or its delta) into the buckets broadcast once it is announced."""
        if self._layout is None:
            self._layout = BucketLayout.plan(hf_specs(model, self.arch, DTYPES[self.dtype]), self.bucket_bytes)
            self._buffers = self._layout.allocate()
        asked = self._asked()  # read every version, so a request is answered once, not again after a whole one
        base, self._held = self._held, None  # the buffers change: they hold a version again once it is packed
        if self.delta and base is not None and self._since_full < self.full_every - 1 and not asked:
            layout, self._sending, checksum, delta = self._encode(model, base)
        else:
            layout, self._sending, delta = self._layout, self._buffers, None
            tensors = full_hf_tensors(model, self.arch)
            checksum = pack_version(layout, self._sending, tensors, f"collective publishing v{version}")
        self._held = version
        self._since_full = 0 if delta is None else self._since_full + 1
        more: dict[str, object] = {}
        if delta is not None:
            more["delta"] = delta
        if self.group.rendezvous is not None:  # engines that join the group themselves learn where here
            more["rendezvous"] = self.group.rendezvous
        return self._buckets_location(layout, **more), checksum, sum(layout.sizes.values())

    def _after_announcing(self, published: Published) -> None:
        """Broadcast the version to the engines, which joined on its announcement."""
        sending, self._sending = self._sending, {}
        self.group.send(published, sending)

    def _encode(self, model: torch.nn.Module, base: int) -> tuple[BucketLayout, dict[str, torch.Tensor], str, dict]:
        """(layout, buffers, checksum, delta description) of the delta from version `base`, which the
        buffers hold, to `model`'s weights; the buffers hold those weights afterwards."""
        digests = {}

        def hashed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in hf_tensors(model, self.arch, DTYPES[self.dtype]):
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
    collective). With a client, each kept version is announced on `stream` (its reader owns the copy)."""

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
        self._writer = DirectoryPublisher(root, arch, client, dtype=dtype, keep=1 << 62, stream=stream)
        inner = publisher
        while isinstance(inner, KeepingPublisher):
            inner = inner.publisher
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
