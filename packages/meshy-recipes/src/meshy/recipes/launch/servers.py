"""Which processes host the data-plane servers. On one node rank 0 hosts them all. Over several, the
first rank of every node hosts its node's storage units, bound to the node's address, and rank 0 (on
node 0) also the controller over every node's units; a producer writes to its own node's units, so
bulk tensors go from producer to local storage to consumer, never through the controller's node unless
the consumer is there. Endpoints travel through torchrun's store (addresses only)."""

import dataclasses
import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from meshy.dataplane import DataPlaneClient, DataPlaneServer, Endpoints
from meshy.recipes.launch.durable_rows import with_rows_dir
from meshy.recipes.launch.kept_rows import announce_written, keep_restored_rows, restored_version, trained_rows
from meshy.recipes.recipe import Recipe
from meshy.recipes.recipe.topology import Slot

STORAGE_KEY = "meshy/dataplane/storage/"  # + node: that node's storage units
START_TIMEOUT_S = 600.0  # as long as the role process groups wait for each other at start


def resume_rows(recipe: Recipe, run_dir: Path, endpoints: Endpoints, secret: bytes, restored: dict) -> dict | None:
    """A resumed run's rows, before any role starts: those its data plane read back from disk that it can use
    are kept (what was kept and dropped returned; None when nothing was read back), and the rollout role told
    which rows not to write again (meshy.recipes.launch.kept_rows)."""
    version = restored_version(run_dir)
    tables = (restored["controller"] or {}).get("rows", {})
    if not version and not any(tables.values()):
        return None  # a fresh run, or one resumed from its start with nothing kept
    trained, trained_after = trained_rows(run_dir, version)
    with DataPlaneClient(endpoints, secret, recipe.dataplane, name="resume") as client:
        restored_rows = any(tables.values())
        kept = (
            keep_restored_rows(recipe, version, client, list(tables), trained, trained_after) if restored_rows else None
        )
        announce_written(recipe, client, version, trained | set(kept.pop("rows_kept") if kept else ()))
    if kept is not None:
        units_torn = sum(unit["torn_bytes"] for unit in restored["storage"] if unit)
        kept["torn_bytes"] = restored["controller"]["torn_bytes"] + units_torn
    return kept


def host_servers(
    recipe: Recipe,
    slot: Slot,
    first_on_node: bool,
    address: str,
    store: dist.Store,
    secret: bytes,
    run_dir: Path,
    meanwhile: Callable[[], object] = lambda: None,
) -> tuple[DataPlaneServer | None, dict | None]:
    """Start the servers this process hosts (None: it hosts none); rank 0 publishes the endpoints. With
    rows kept on disk from a stopped run, rank 0 first drops those the resumed run cannot use, and returns
    what it kept (meshy.recipes.launch.kept_rows; None: nothing was restored). `meanwhile` runs in every
    process, while the servers start where it hosts them."""
    if not first_on_node:
        meanwhile()
        return None, None
    nodes = recipe.topology.nodes
    config = dataclasses.replace(recipe.dataplane, host=address) if nodes > 1 else recipe.dataplane
    config = with_rows_dir(config, recipe, run_dir, slot.node)
    log_name = "dataplane.log" if slot.node == 0 else f"dataplane-node{slot.node}.log"
    with open(run_dir / "logs" / log_name, "ab") as log:  # the servers keep their own descriptor
        server = DataPlaneServer.start_storage(secret, config, log=log, meanwhile=meanwhile)
    store.set(f"{STORAGE_KEY}{slot.node}", json.dumps(server.storage))
    kept = None
    if slot.rank == 0:
        units, where = [], []
        for node in range(nodes):
            store.wait([f"{STORAGE_KEY}{node}"], timedelta(seconds=START_TIMEOUT_S))
            storage = json.loads(store.get(f"{STORAGE_KEY}{node}"))
            units += storage
            where += [node] * len(storage)
        endpoints = server.start_controller(units, where)
        kept = resume_rows(recipe, run_dir, endpoints, secret, server.restored)
        server.publish(store)
    return server, kept
