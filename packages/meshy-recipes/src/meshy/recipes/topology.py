"""Which rank runs which role on which device: one pure function every rank evaluates identically.

Roles get consecutive ranks in a fixed order (training first, so global rank 0 is training rank 0 and
hosts the data plane). Roles in one colocation ring, or in one `share_devices` group, share devices:
the i-th process of each uses the same GPUs (in a ring they take turns, in a group they run at once).
On a host without GPUs every role runs on the CPU.
"""

from dataclasses import dataclass

from meshy.dataplane import SchemaError
from meshy.recipes.recipe import Recipe


@dataclass(frozen=True)
class Slot:
    """One rank's job: process `index` of `count` of `role`, on `devices` (empty: CPU), in `ring`."""

    rank: int
    role: str
    index: int
    count: int
    devices: tuple[int, ...]
    ring: str | None

    @property
    def device(self) -> str:
        return f"cuda:{self.devices[0]}" if self.devices else "cpu"


def assign(recipe: Recipe, world_size: int, gpus_per_node: int = 0) -> dict[int, Slot]:
    """rank -> Slot for every rank of a world of `world_size` processes."""
    if world_size != recipe.world_size:
        raise SchemaError(
            f"world size {world_size} does not match the recipe's {recipe.world_size} processes "
            f"({', '.join(f'{name}: {spec.processes}' for name, spec in recipe.roles.items())})"
        )
    rings = {role: "+".join(ring) for ring in recipe.colocate for role in ring}
    sharing = {role: "+".join(group) for group in (*recipe.colocate, *recipe.share_devices) for role in group}
    slots, rank, next_device, shared_devices = {}, 0, 0, {}
    for name, spec in recipe.roles.items():
        for index in range(spec.processes):
            devices: tuple[int, ...] = ()
            if gpus_per_node and spec.devices_per_process:
                group = sharing.get(name)
                key = (group, index)
                if group is not None and key in shared_devices:
                    devices = shared_devices[key]
                else:
                    devices = tuple(range(next_device, next_device + spec.devices_per_process))
                    next_device += spec.devices_per_process
                    if group is not None:
                        shared_devices[key] = devices
                if devices[-1] >= gpus_per_node:
                    raise SchemaError(
                        f"roles.{name}.devices_per_process: the recipe needs more than the {gpus_per_node} GPUs "
                        "per node this launcher supports"
                    )
            slots[rank] = Slot(rank, name, index, spec.processes, devices, rings.get(name))
            rank += 1
    return slots
