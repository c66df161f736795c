"""Colocated roles share devices through a GPU token ring: the i-th process of each role in a ring
shares ring `<roles>-<i>`. Inference is the FALLBACK member (it generates whenever nobody else needs the
devices); the others are ON_DEMAND (they ask before each burst of compute, and hand the devices back)."""

import torch

from meshy.dataplane import FALLBACK, ON_DEMAND, GpuTokenRing, Grant
from meshy.recipes.context import RoleContext


def join_ring(ctx: RoleContext, on_acquire, on_release) -> GpuTokenRing | None:
    """This process's handle on its ring, or None if its role is not colocated."""
    ring = next((r for r in ctx.recipe.colocate if ctx.slot.role in r), None)
    if ring is None:
        return None
    members = [(role, FALLBACK if role == "inference" else ON_DEMAND) for role in ring]

    def acquired(grant: Grant) -> None:
        ctx.record("grant", ring=grant_ring(ring, ctx), seq=grant.seq, holder=grant.holder, payload=grant.payload)
        on_acquire(grant)

    return GpuTokenRing(
        ctx.client, grant_ring(ring, ctx), ctx.slot.role, members, on_acquire=acquired, on_release=on_release
    )


def grant_ring(ring: tuple[str, ...], ctx: RoleContext) -> str:
    return f"{'+'.join(ring)}-{ctx.slot.index}"


def record_released(ctx: RoleContext) -> None:
    """Record what this process still holds on its GPU after handing the ring's token over (`meshy
    inspect` and the GPU check read it): what it allocated, and what torch keeps reserved for it."""
    if ctx.slot.devices:
        device = torch.device(ctx.slot.device)
        ctx.record(
            "released",
            allocated=torch.cuda.memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device),
        )
