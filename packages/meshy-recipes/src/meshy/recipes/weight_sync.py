"""Who is in a run's weight-sync group (collective publishing), derived from the recipe like every other
part of the topology: training process 0 publishes as group rank 0, inference process i receives as
group rank 1 + i. Every member builds the group at start, before its role runs."""

import torch.distributed as dist

from meshy.dataplane.weight_sync import WeightSyncGroup
from meshy.recipes.recipe import Recipe
from meshy.recipes.topology import Slot

JOIN_TIMEOUT_S = 600.0  # as long as the role process groups wait for each other at start


def weight_sync_rank(recipe: Recipe, slot: Slot) -> int | None:
    """This slot's rank in the weight-sync group, or None if it is not a member (or there is none)."""
    if recipe.publish != "collective":
        return None
    if slot.role == "training" and slot.index == 0:
        return 0
    if slot.role == "inference":
        return 1 + slot.index
    return None


def join_weight_sync(recipe: Recipe, slot: Slot, store: dist.Store) -> WeightSyncGroup | None:
    rank = weight_sync_rank(recipe, slot)
    if rank is None:
        return None
    return WeightSyncGroup(store, rank, 1 + recipe.roles.inference.processes, timeout_s=JOIN_TIMEOUT_S)
