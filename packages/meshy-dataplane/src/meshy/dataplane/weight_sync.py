"""The collective weights transport: the publishing trainer broadcasts each version, in buckets, to every
engine process over a process group of their own, the weight-sync group.

Members derive the group from the topology at start (nothing is discovered at run time): rank 0 is the
publisher, ranks 1.. the engines. The `weights` stream stays the only signal: it announces a version
(its manifest of buckets and its checksum) before the buckets are broadcast, an engine that reads the
announcement joins the broadcast, and checks the checksum before it loads anything. A version may be a
delta on the one before (meshy.dataplane.weight_delta). Each engine receives every whole version into
the same buffers (planned once from the announced layout) and applies deltas to them in place, so it
holds one copy of the version besides its model; the publisher likewise fills the same buffers. The
publisher broadcasts each version once and every engine joins every version, in order; a member that
dies fails the others' broadcast (gloo notices the closed connection), and one that never joins fails
it at the group's timeout.

Engines that run their weights in processes of their own (SGLang's schedulers) join through their own
code instead: the publisher then hosts the group's rendezvous (`WeightSyncGroup.hosting`), announces
where it is with every version, and the members form the group as torch's named-group helper does
(SGLang's init_weights_update_group); inside them, `WeightSyncGroup.over` receives and verifies.

The group runs on gloo over host buffers, on CPU and GPU hosts alike (NCCL is not wired yet).
"""

import json
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from meshy.dataplane import weight_delta
from meshy.dataplane.adapters import is_adapter_tensor
from meshy.dataplane.errors import SchemaError, WeightSyncError
from meshy.dataplane.weights import (
    BucketLayout,
    CorruptWeights,
    Published,
    Transport,
    check_base,
    check_checksum,
    check_held_base,
    combine_digests,
    digest_later,
    tensor_digest,
    unpack_buckets,
)

STORE_PREFIX = "meshy/weight-sync"
PUBLISHER = 0  # the group rank that broadcasts


class WeightSyncGroup:
    """This process's membership of the run's weight-sync group (`size` members, this one `rank`),
    rendezvousing through `store`. Construction waits until every member has joined."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float = 300.0):
        self._setup(rank, size, timeout_s)
        self._group = self._connect(dist.PrefixStore(STORE_PREFIX, store))

    @classmethod
    def over(cls, group: dist.ProcessGroup, timeout_s: float = 300.0) -> "WeightSyncGroup":
        """Membership of a group formed by other code (SGLang's weights update group), as its rank."""
        member = cls.__new__(cls)
        member._setup(group.rank(), group.size(), timeout_s)
        member._group = group
        return member

    @classmethod
    def hosting(cls, address: str, size: int, name: str, timeout_s: float = 300.0) -> "WeightSyncGroup":
        """The publisher (rank 0) of a group whose members form it with torch's named-group helper over
        tcp://address:port (`rendezvous`, which every announced version carries): this hosts the
        rendezvous store on a free port, and the group forms at the first send, when the members have
        read the announcement; it waits `timeout_s` for them."""
        member = cls.__new__(cls)
        member._setup(PUBLISHER, size, timeout_s)
        member._store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=member._timeout)
        member.rendezvous = {"address": address, "port": member._store.port, "group": name, "size": size}
        # The keys torch's _new_process_group_helper gives a gloo group named `name` that was formed over a
        # tcp:// rendezvous prefixed with its name (SGLang's init_custom_process_group).
        keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, member._store)))
        member._group = None
        member._form = lambda: member._connect(keys)
        return member

    def _setup(self, rank: int, size: int, timeout_s: float) -> None:
        if size < 2 or not 0 <= rank < size:
            raise SchemaError(f"weight-sync group: expected 0 <= rank < size and size >= 2, got rank {rank} of {size}")
        if not timeout_s > 0:
            raise SchemaError(f"weight-sync group timeout_s: expected seconds > 0, got {timeout_s!r}")
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._timeout = timedelta(seconds=timeout_s)
        self.rendezvous: dict | None = None  # where members join, when they form the group themselves
        self._form: Callable[[], dist.ProcessGroup] | None = None
        self._layout: BucketLayout | None = None  # of the last whole version, received into _buffers
        self._buffers: dict[str, torch.Tensor] = {}
        self._base: dict[str, torch.Tensor] = {}  # views into _buffers: what deltas apply to
        self._base_version: int | None = None  # the version _base holds, if it holds one intact

    def _connect(self, store: dist.Store) -> dist.ProcessGroup:
        try:
            return dist.ProcessGroupGloo(store, self.rank, self.size, self._timeout)
        except RuntimeError as e:  # a member did not join in time, or died while the members connected
            raise WeightSyncError(
                f"weight-sync group rank {self.rank} of {self.size}: could not connect to every member (not "
                f"every member joined within {self.timeout_s:.0f} s, or one died meanwhile): {e}"
            ) from None

    def send(self, published: Published, buffers: Mapping[str, torch.Tensor]) -> None:
        """Broadcast a version's buckets (flat uint8 host tensors, in the announced layout's order) to
        every engine; returns once every engine has them."""
        if self.rank != PUBLISHER:
            raise SchemaError(f"weight-sync group: rank {self.rank} receives; only rank {PUBLISHER} sends")
        if self._group is None:
            self._group = self._form()
        for i, buffer in enumerate(buffers.values()):
            self._broadcast(buffer, f"v{published.version} bucket {i + 1}/{len(buffers)}")

    def receive(self, published: Published, held_base: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
        """(config.json, name -> tensor) of an announced version, after verifying its checksum
        (CorruptWeights if it does not match, or if it is a delta on a version this member does not hold:
        then the next full version puts it back on track).

        An adapter version carries its adapters, and its base's HF tensors when it is the publisher's first
        or one an engine asked for whole (checked against Adapter.base); an adapter-only version is
        CorruptWeights naming the base unless `held_base` is its Adapter.base (the caller's engine holds it).
        Either way every version is received: the broadcast needs every member.

        The tensors are views into this member's buffers, valid until the next receive: a whole version
        is received into the same buffers every time (planned again when its layout changes, as between an
        adapter version with its base and one without), and a delta is applied to them in place."""
        if published.transport is not Transport.COLLECTIVE:
            raise SchemaError(
                f"weights v{published.version}: {published.transport} version: expected {Transport.COLLECTIVE}"
            )
        if self.rank == PUBLISHER:
            raise SchemaError(f"weight-sync group: rank {PUBLISHER} sends; it does not receive")
        meta = json.loads(published.location)
        layout, delta = BucketLayout.of(meta), meta.get("delta")
        if delta is None and layout != self._layout:
            self._layout, self._buffers = layout, layout.allocate()
        held, self._base_version = self._base_version, None  # the buffers change: a version once one verifies
        buffers = self._buffers if delta is None else layout.allocate()
        tensors, digests = self._receive_buckets(published.version, layout, buffers, digest=delta is None)
        if delta is None:
            digests = {name: d.result() for name, d in digests.items()}
            check_checksum(published, combine_digests(digests))
        else:
            if delta["base"] != held:
                raise CorruptWeights(
                    f"weights v{published.version}: a delta on v{delta['base']}, and this engine holds "
                    f"v{held}; it waits for the next full version"
                )
            # the tensors the delta names: an adapter delta's base version may have carried the base too
            base = {name: self._base[name] for name in delta["names"] if name in self._base}
            tensors = weight_delta.apply(published.version, tensors, base, delta)
            digests = {name: tensor_digest(t) for name, t in tensors.items()}
            check_checksum(published, combine_digests(digests))
        self._base, self._base_version = tensors, published.version
        if published.adapter is not None:
            _check_adapter_base(published, digests, held_base)
        return meta["config"], tensors

    def _receive_buckets(
        self, version: int, layout: BucketLayout, buffers: dict[str, torch.Tensor], digest: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, Future]]:
        """Views of the received tensors, and (digest) their digests, each computed while the buckets
        after its own are received."""
        tensors = unpack_buckets(layout.manifest, buffers, copy=False)
        in_bucket: dict[str, list[str]] = {}
        for entry in layout.manifest:
            in_bucket.setdefault(entry["bucket"], []).append(entry["name"])
        digests = {}
        for i, bucket in enumerate(layout.sizes):
            self._broadcast(buffers[bucket], f"v{version} bucket {i + 1}/{len(layout.sizes)}")
            if digest:
                digests.update((name, digest_later(tensors[name])) for name in in_bucket.get(bucket, []))
        return tensors, digests

    def _broadcast(self, buffer: torch.Tensor, what: str) -> None:
        try:
            self._group.broadcast([buffer], dist.BroadcastOptions()).wait()
        except RuntimeError as e:
            raise WeightSyncError(
                f"weight-sync group rank {self.rank} of {self.size}: broadcast of {what} failed "
                f"(a member died, or did not join within {self.timeout_s:.0f} s): {e}"
            ) from None


def _check_adapter_base(published: Published, digests: Mapping[str, bytes], held_base: str | None) -> None:
    """An adapter version's base: the one it carries must be Adapter.base; without one, the caller must hold it."""
    base = {name: digest for name, digest in digests.items() if not is_adapter_tensor(name)}
    if base:
        check_base(published, combine_digests(base))
    else:
        check_held_base(published, held_base)
