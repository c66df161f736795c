"""Who is in a run's weight-sync group (collective publishing), derived from the recipe like every other
part of the topology: training process 0 publishes as group rank 0, and each inference process receives
in ranks of its own, in process order: one rank with the pure-torch engine (the process itself), one per
SGLang scheduler (tensor-parallel width) with SGLang, whose schedulers join the group through SGLang's
own update group, where the publisher hosts it. The other members build the group at start, before
their role runs; SGLang's schedulers join at the first version, whose announcement says where."""

import torch.distributed as dist

from meshy.dataplane.weight_sync import WeightSyncGroup
from meshy.dataplane.weights import Transport
from meshy.recipes.recipe import Recipe
from meshy.recipes.recipe.topology import Slot

JOIN_TIMEOUT_S = 600.0  # as long as the role process groups wait for each other at start
SGLANG_GROUP = "meshy-weights"  # the update group's name in SGLang's schedulers


def _ranks_of(recipe: Recipe, slot: Slot) -> int:
    """How many ranks of the group an inference process takes."""
    return max(len(slot.devices), 1) if recipe.sampling.engine == "sglang" else 1


def weight_sync_rank(recipe: Recipe, slot: Slot) -> int | None:
    """This slot's (first) rank in the weight-sync group, or None if it is not a member (or there is none)."""
    if recipe.publish is not Transport.COLLECTIVE:
        return None
    if slot.role == "training" and slot.index == 0:
        return 0
    if slot.role == "inference":
        return 1 + slot.index * _ranks_of(recipe, slot)  # every inference process is as wide as the others
    return None


def join_weight_sync(
    recipe: Recipe, slot: Slot, slots: list[Slot], store: dist.Store, address: str
) -> WeightSyncGroup | None:
    """This process's membership, if it is a member that joins at start; `address`: this node's, where a
    publisher for SGLang hosts the group."""
    rank = weight_sync_rank(recipe, slot)
    if rank is None:
        return None
    size = 1 + sum(_ranks_of(recipe, s) for s in slots if s.role == "inference")
    if recipe.sampling.engine != "sglang":
        return WeightSyncGroup(store, rank, size, timeout_s=JOIN_TIMEOUT_S)
    if rank == 0:
        return WeightSyncGroup.hosting(address, size, SGLANG_GROUP, timeout_s=JOIN_TIMEOUT_S)
    return None  # its schedulers join, from the engine
