"""Publishing trained weights: each version as a Hugging Face directory, as shared-memory buckets, or as
buckets broadcast to the engines on the weight-sync group (meshy.dataplane.weight_sync).

Both publishers gather the model tensor by tensor (a DTensor's `full_tensor` is a collective every
rank joins; only rank 0 keeps the result), so no rank ever holds a second copy of the whole model. Rank
0 writes, then announces the version on the data plane's `weights` stream (meshy.dataplane.weights
defines the message and the verified reader).
"""

import json
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from meshy.dataplane import HOST, DataPlaneClient, SchemaError, weight_delta
from meshy.dataplane.weight_sync import WeightSyncGroup
from meshy.dataplane.weights import (
    COLLECTIVE,
    DISK,
    DTYPES,
    SHARED_MEMORY,
    WEIGHTS_STREAM,
    Published,
    bucket_nbytes,
    combine_digests,
    pack_bucket,
    tensor_digest,
)
from meshy.train.models import DecoderArch

# Tensor digests are computed on a helper thread while the shards are written (xxhash and safetensors'
# writer both release the GIL), so the checksum costs next to nothing on top of the write.
_digester = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshy-weights-digest")


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def hf_tensors(model: torch.nn.Module, arch: DecoderArch, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs gathered one at a time. Every rank must iterate; only rank 0 gets data."""
    adapter = arch.state_dict_adapter()
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if _is_writer():
            for hf_name, tensor in adapter.to_hf({name: full.detach()}).items():
                yield hf_name, tensor.to(dtype).cpu().contiguous()  # converted where it lives (GPU: on device)


def bucketed(tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Tensors in order, grouped into buckets of at most `bucket_bytes` (a larger tensor goes alone)."""
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    group_bytes = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if groups[-1] and group_bytes + size > bucket_bytes:
            groups.append([])
            group_bytes = 0
        groups[-1].append((name, tensor))
        group_bytes += size
    return groups


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise SchemaError(f"publish dtype: expected one of {list(DTYPES)}, got {dtype!r}")


class DirectoryPublisher:
    """Writes version v to `root/v{v:06d}`: config.json, model.safetensors (or shards and an index).
    The directory is built under a temporary name and renamed into place, so no reader ever sees half a
    version (a process crash leaves only the temporary; torn writes after power loss fail the checksum)."""

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
        _check_dtype(dtype)
        if keep < 1:
            raise SchemaError(f"publish keep: expected >= 1 versions, got {keep}")
        self.root = Path(root)
        self.arch = arch
        self.client = client
        self.stream = stream
        self.dtype = dtype
        self.max_shard_bytes = max_shard_bytes
        self.keep = keep

    def publish(self, model: torch.nn.Module, version: int) -> Published | None:
        """Every rank calls this; rank 0 writes, announces and returns what it announced."""
        start = time.perf_counter()
        final = self.root / f"v{version:06d}"
        tmp = self.root / f".v{version:06d}.tmp{os.getpid()}"
        if _is_writer():
            if final.exists():
                raise SchemaError(f"weights version {version} already exists at {final}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        shard: dict[str, torch.Tensor] = {}
        shard_bytes, weight_map, files, digests = 0, {}, [], {}
        for name, tensor in hf_tensors(model, self.arch, DTYPES[self.dtype]):
            digests[name] = _digester.submit(tensor_digest, tensor)  # hashed while shards are written
            size = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + size > self.max_shard_bytes:
                files.append(self._write(tmp, len(files), shard))
                shard, shard_bytes = {}, 0
            shard[name] = tensor
            weight_map[name] = len(files)
            shard_bytes += size
        if not _is_writer():
            return None
        files.append(self._write(tmp, len(files), shard))
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
        published = Published(version, DISK, str(final), checksum, num_bytes, time.perf_counter() - start)
        if self.client is not None:
            self.client.append(self.stream, published.to_message())
        self._prune(version)
        return published

    @staticmethod
    def _write(directory: Path, i: int, tensors: dict[str, torch.Tensor]) -> str:
        name = f".shard{i}.safetensors"
        save_file(tensors, directory / name, metadata={"format": "pt"})
        return name

    def _prune(self, version: int) -> None:
        """Keep the newest `keep` versions (readers load the latest one announced)."""
        for old in self.root.glob("v[0-9]*"):
            if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) <= version - self.keep:
                shutil.rmtree(old, ignore_errors=True)


class SharedMemoryPublisher:
    """Same-host path: a version's tensors packed into POSIX shared-memory buckets, with a manifest of
    (name, dtype, shape, bucket, offset) in the announcement. Nothing touches disk."""

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
        _check_dtype(dtype)
        if keep < 1:
            raise SchemaError(f"publish keep: expected >= 1 versions, got {keep}")
        self.prefix = prefix
        self.arch = arch
        self.client = client
        self.stream = stream
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        self.keep = keep
        self._versions: dict[int, list[shared_memory.SharedMemory]] = {}

    def publish(self, model: torch.nn.Module, version: int) -> Published | None:
        start = time.perf_counter()
        groups = bucketed(hf_tensors(model, self.arch, DTYPES[self.dtype]), self.bucket_bytes)
        if not _is_writer():
            return None
        manifest, buckets = [], []
        for i, group in enumerate(groups):
            buckets.append(self._write_bucket(f"{self.prefix}-v{version}-b{i}", group, manifest))
        sizes = {shm.name: bucket_nbytes(group) for shm, group in zip(buckets, groups, strict=True)}
        meta = {"config": self.arch.hf_config(self.dtype), "buckets": sizes, "tensors": manifest}
        digest = combine_digests({name: tensor_digest(tensor) for group in groups for name, tensor in group})
        published = Published(
            version, SHARED_MEMORY, json.dumps(meta), digest, sum(sizes.values()), time.perf_counter() - start
        )
        self._versions[version] = buckets
        if self.client is not None:
            self.client.append(self.stream, published.to_message())
        for old in [v for v in self._versions if v <= version - self.keep]:
            self._unlink(old)
        return published

    @staticmethod
    def _write_bucket(name: str, tensors: list[tuple[str, torch.Tensor]], manifest: list) -> shared_memory.SharedMemory:
        size = bucket_nbytes(tensors)
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
        buffer = torch.frombuffer(shm.buf, dtype=torch.uint8, count=max(size, 1))
        pack_bucket(buffer, name, tensors, manifest)
        del buffer  # no view may outlive the mapping
        return shm

    def _unlink(self, version: int) -> None:
        for shm in self._versions.pop(version):
            shm.close()
            shm.unlink()

    def close(self) -> None:
        """Unlink every version still held (readers must have loaded them)."""
        for version in list(self._versions):
            self._unlink(version)


class CollectivePublisher:
    """Version v as buckets that training rank 0 broadcasts to every engine on the weight-sync group, after
    announcing it (config, bucket manifest, checksum) on the `weights` stream so the engines join. Nothing
    touches disk; rank 0 holds one packed copy of the version while it is sent.

    delta: send what changed since the previous version (meshy.dataplane.weight_delta), every
    `full_every`-th version whole, so an engine that could not apply a delta is back on track by then;
    rank 0 then also keeps the previous version."""

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
        _check_dtype(dtype)
        if bucket_bytes < 1 or full_every < 1:
            raise SchemaError(
                f"collective publishing: bucket_bytes and full_every >= 1, got {bucket_bytes}, {full_every}"
            )
        if group is None and _is_writer():
            raise SchemaError("collective publishing: training rank 0 needs the weight-sync group")
        self.group = group
        self.arch = arch
        self.client = client
        self.stream = stream
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        self.delta = delta
        self.full_every = full_every
        self._base: dict[str, torch.Tensor] = {}  # the previous version, when sending deltas
        self._base_version: int | None = None
        self._since_full = 0

    def publish(self, model: torch.nn.Module, version: int) -> Published | None:
        """Every rank calls this (the gather is a collective); rank 0 announces, then broadcasts."""
        start = time.perf_counter()
        current = dict(hf_tensors(model, self.arch, DTYPES[self.dtype]))
        if not _is_writer():
            return None
        checksum = combine_digests({name: tensor_digest(tensor) for name, tensor in current.items()})
        segments, delta = list(current.items()), None
        if self.delta and self._base_version is not None and self._since_full < self.full_every - 1:
            segments, delta = weight_delta.encode(current, self._base)
            delta["base"] = self._base_version
        self._since_full = 0 if delta is None else self._since_full + 1
        manifest, buckets, sizes = [], [], {}
        for i, group in enumerate(bucketed(iter(segments), self.bucket_bytes)):
            name = f"b{i}"
            sizes[name] = bucket_nbytes(group)
            buckets.append(torch.empty(sizes[name], dtype=torch.uint8, device=HOST))
            pack_bucket(buckets[-1], name, group, manifest)
        del segments
        meta = {"config": self.arch.hf_config(self.dtype), "buckets": sizes, "tensors": manifest}
        if delta is not None:
            meta["delta"] = delta
        seconds = time.perf_counter() - start  # gathered and packed
        published = Published(version, COLLECTIVE, json.dumps(meta), checksum, sum(sizes.values()), seconds)
        if self.client is not None:
            self.client.append(self.stream, published.to_message())
        self.group.send(published, buckets)
        if self.delta:
            self._base, self._base_version = current, version
        return published
