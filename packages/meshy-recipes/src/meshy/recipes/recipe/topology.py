"""Which rank runs which role on which node and device: one pure function every rank evaluates identically.

Roles are placed in a fixed order (training first, so rank 0 is training process 0, on node 0, and
hosts the data plane). A role's processes are placed contiguously: each takes the next free GPUs of the
current node and moves to the next node when this one is full (a process never straddles nodes); a
role may name the node it starts on (`roles.<name>.node`), and the roles after it follow it there.
Processes without GPUs stay on the current node. Roles in one colocation ring, or in one
`share_devices` group, share devices: the i-th process of each uses the same node and GPUs (in a ring
they take turns, in a group they run at once). Ranks are numbered node by node, so a node's processes
are consecutive ranks and its local rank is its place among them. On a host without GPUs every role
runs on the CPU, in the same places.
"""

from dataclasses import dataclass, replace

from meshy.dataplane import SchemaError
from meshy.recipes.recipe.spec import Recipe


@dataclass(frozen=True)
class Slot:
    """One rank's job: process `index` of `count` of `role`, on `devices` (empty: CPU) of `node`, in `ring`."""

    rank: int
    role: str
    index: int
    count: int
    devices: tuple[int, ...]
    ring: str | None
    node: int = 0

    @property
    def device(self) -> str:
        return f"cuda:{self.devices[0]}" if self.devices else "cpu"


def layout(recipe: Recipe, gpus_per_node: int) -> list[Slot]:
    """Every process of the recipe placed on `recipe.topology.nodes` nodes of `gpus_per_node` GPUs (0:
    placed as if on CPUs), in rank order. Raises SchemaError naming the field that makes it impossible."""
    nodes = recipe.topology.nodes
    rings = {role: "+".join(ring) for ring in recipe.colocate for role in ring}
    sharing = {role: "+".join(group) for group in (*recipe.colocate, *recipe.share_devices) for role in group}
    placed: list[Slot] = []
    node, next_device, shared = 0, [0] * nodes, {}
    for name, spec in recipe.roles.items():
        if spec.node is not None:
            if spec.node >= nodes:
                raise SchemaError(
                    f"roles.{name}.node: no node {spec.node}; topology.nodes = {nodes} (nodes 0-{nodes - 1})"
                )
            node = spec.node
        needs = spec.devices_per_process if gpus_per_node else 0
        if needs > gpus_per_node:
            raise SchemaError(
                f"roles.{name}.devices_per_process: {needs} GPUs per process, more than a node's {gpus_per_node}"
            )
        for index in range(spec.processes):
            key = (sharing.get(name), index)
            if key[0] is not None and key in shared:
                at, devices = shared[key]
                if spec.node is not None and spec.node != at:
                    raise SchemaError(
                        f"roles.{name}.node: {name} shares its devices with {key[0]} (process {index} on node "
                        f"{at}), so it runs where they are; remove roles.{name}.node"
                    )
            else:
                if needs and next_device[node] + needs > gpus_per_node:
                    node += 1  # this node is full: the process starts the next one
                if node >= nodes:
                    raise SchemaError(
                        f"roles.{name}.processes: {spec.processes} processes of {needs} GPUs do not fit on the "
                        f"nodes left (topology.nodes = {nodes}, {gpus_per_node} GPUs each); add nodes or move roles"
                    )
                at, devices = node, tuple(range(next_device[node], next_device[node] + needs))
                next_device[node] += needs
                if key[0] is not None:
                    shared[key] = (at, devices)
            placed.append(Slot(-1, name, index, spec.processes, devices, rings.get(name), at))
    empty = sorted(set(range(nodes)) - {slot.node for slot in placed})
    if empty:
        raise SchemaError(
            f"topology.nodes: {nodes} nodes, but no process is placed on node {empty[0]}; place roles there "
            "(roles.<name>.node) or use fewer nodes"
        )
    ordered = sorted(placed, key=lambda slot: slot.node)  # stable: within a node, in role order
    return [replace(slot, rank=rank) for rank, slot in enumerate(ordered)]


def assign(recipe: Recipe, world_size: int, gpus_per_node: int = 0) -> dict[int, Slot]:
    """rank -> Slot for every rank of a world of `world_size` processes, on nodes with `gpus_per_node` GPUs
    each (this host's). A recipe that names its GPUs per node is placed by it, and needs that many here."""
    if world_size != recipe.world_size:
        raise SchemaError(
            f"world size {world_size} does not match the recipe's {recipe.world_size} processes "
            f"({', '.join(f'{name}: {spec.processes}' for name, spec in recipe.roles.items())})"
        )
    declared = recipe.topology.gpus_per_node
    slots = layout(recipe, gpus_per_node if declared is None else declared)
    if declared is not None and gpus_per_node == 0:
        slots = [replace(slot, devices=()) for slot in slots]  # no GPUs here: the same places, on CPUs
    elif declared is not None and 0 < gpus_per_node < max((d + 1 for s in slots for d in s.devices), default=0):
        raise SchemaError(
            f"topology.gpus_per_node: the recipe places {declared} GPUs per node; this node has {gpus_per_node}"
        )
    return {slot.rank: slot for slot in slots}


def on_node(slots: dict[int, Slot], node: int) -> list[Slot]:
    """The node's slots in rank order: a process's local rank is its place in this list."""
    return [slot for slot in slots.values() if slot.node == node]
