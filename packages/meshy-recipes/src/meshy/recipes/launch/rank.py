"""What every rank runs (started by `meshy.recipes.launch`, torchrun's entry module, once it dies with its agent).

Every rank loads the same recipe and computes the same topology, and finds its slot by its node
(MESHY_NODE_RANK) and its local rank; the first rank of each node hosts that node's data-plane storage
units, rank 0 also the controller, whose endpoints it publishes in torchrun's TCPStore
(meshy.recipes.launch.servers). Each role process then joins its own role's
process group (if the role has several processes) and runs its loop until the run is over. There is
no driver: roles meet only on the data plane.
"""

import contextlib
import gc
import os
import sys
import time

import torch
import torch.distributed as dist

from meshy.dataplane import DataPlaneClient, Endpoints, secret_from_env
from meshy.recipes.launch.kept_rows import kept_rows_line
from meshy.recipes.launch.nodes import NODE_ADDRESS_ENV, node_address, run_dir
from meshy.recipes.launch.restarts import supervise
from meshy.recipes.launch.role_process import connect_store, import_role, run_role, this_slot, use_devices
from meshy.recipes.launch.servers import host_servers
from meshy.recipes.launch.startup import phase_done
from meshy.recipes.launch.watchdog import Watchdog
from meshy.recipes.recipe import load_recipe
from meshy.recipes.recipe.dataflow import tables
from meshy.recipes.roles.context import RecordKind, RoleContext
from meshy.recipes.roles.sync_group import join_weight_sync
from meshy.train.process_group import init_process_group

DONE_KEY = "meshy/done"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    recipe_path = argv[0] if argv else None
    recipe = load_recipe(recipe_path)
    slot, here, slots = this_slot(recipe)
    if slot.rank == 0:
        phase_done("processes started")
    # A role that restarts in place runs in a child (meshy.recipes.launch.restarts), which takes the slot's
    # devices; this process only supervises it, and joins no process group.
    restarts = getattr(dict(recipe.roles.items())[slot.role], "max_restarts", 0)
    if restarts:
        torch.set_num_threads(1)
    else:
        use_devices(recipe, slot)
    directory = run_dir(recipe)
    (directory / "logs").mkdir(parents=True, exist_ok=True)
    world = recipe.world_size
    store = connect_store(recipe)
    secret = secret_from_env()
    address = os.environ.get(NODE_ADDRESS_ENV) or node_address(recipe, slot.node, os.environ["MASTER_ADDR"])
    # the role's imports overlap the servers' start (a restarting role's child makes its own)
    warm_up = (lambda: None) if restarts else (lambda: import_role(recipe, slot))
    server, kept = host_servers(recipe, slot, slot is here[0], address, store, secret, directory, warm_up)
    endpoints = Endpoints.from_store(store)
    if slot.rank == 0:
        phase_done("data plane up")
    client = DataPlaneClient(endpoints, secret, recipe.dataplane, name=f"{slot.role}{slot.index}", node=slot.node)
    for spec in tables(recipe):
        client.create_table(spec)
    if slot.count > 1 and not restarts:
        init_process_group(
            slot.device,
            store=dist.PrefixStore(f"meshy/role/{slot.role}", store),
            rank=slot.index,
            world_size=slot.count,
        )
    weight_sync = join_weight_sync(recipe, slot, slots, store, address)
    ctx = RoleContext(recipe, slot, directory, client, weight_sync=weight_sync)
    servers = server.pids if server is not None else None
    published = endpoints.to_json() if slot.rank == 0 else None  # where the data plane listens, for audits
    where = {"rank": slot.rank, "node": slot.node, "address": address}
    ctx.record(
        RecordKind.START,
        **where,
        pid=os.getpid(),
        threads=torch.get_num_threads(),
        dataplane=servers,
        endpoints=published,
    )
    if kept is not None:
        ctx.record(RecordKind.KEPT_ROWS, **kept)
        print(kept_rows_line(kept), flush=True)
    watched = [spec.name for spec in tables(recipe)]
    watchdog = Watchdog(client, watched, directory, recipe.stall_after_s) if slot.rank == 0 else None
    if watchdog is not None:
        watchdog.start()
    try:
        failed = supervise(ctx, recipe_path, restarts) if restarts else run_role(ctx)
    finally:
        if watchdog is not None:
            watchdog.stop()
        ctx.record_traffic(client.storage_bytes(), endpoints.storage_nodes)
        with contextlib.suppress(dist.DistError):  # the store's node may be gone: nobody is left to wait for
            store.add(DONE_KEY, 1)
            deadline = time.monotonic() + 120
            while server is not None and store.add(DONE_KEY, 0) < world and time.monotonic() < deadline:
                time.sleep(0.2)  # others may still read what this node's storage units hold
        client.close()
        if server is not None:
            server.shutdown()
    gc.freeze()  # no final collection over torch's heap at exit: ~1 s of CPU per rank, nothing left to finalize
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
