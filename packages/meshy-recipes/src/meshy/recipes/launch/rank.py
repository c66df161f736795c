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
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from meshy.dataplane import DataPlaneClient, DataPlaneError, Endpoints, SchemaError, secret_from_env
from meshy.recipes.launch.nodes import NODE_ADDRESS_ENV, node_address, node_rank, run_dir
from meshy.recipes.launch.restarts import supervise
from meshy.recipes.launch.servers import host_servers
from meshy.recipes.launch.startup import phase_done
from meshy.recipes.launch.watchdog import Watchdog
from meshy.recipes.recipe import CustomRoleSpec, Recipe, RoleSpec, load_recipe
from meshy.recipes.recipe.dataflow import tables
from meshy.recipes.recipe.topology import Slot, assign, on_node
from meshy.recipes.roles.context import RecordKind, RoleContext, announce_stop
from meshy.recipes.roles.sync_group import join_weight_sync
from meshy.recipes.usercode.imports import import_object
from meshy.recipes.usercode.task_errors import TASK_ERROR_FILE, TaskError
from meshy.train.process_group import init_process_group

DONE_KEY = "meshy/done"


def role_class(recipe: Recipe, slot: Slot) -> type:
    builtin = {
        "training": "meshy.recipes.roles.training:TrainingRole",
        "inference": "meshy.recipes.roles.inference:InferenceRole",
        "rollout": "meshy.recipes.roles.rollout:RolloutRole",
        "environment": "meshy.recipes.roles.environment:EnvironmentRole",
        "critic": "meshy.recipes.roles.critic:CriticRole",
        "teacher": "meshy.recipes.roles.teacher:TeacherRole",
        "reference": "meshy.recipes.roles.reference:ReferenceRole",
        "eval": "meshy.recipes.roles.eval:EvalRole",
    }
    if slot.role in builtin:
        return import_object(builtin[slot.role], f"roles.{slot.role}")
    return import_object(next(c.cls for c in recipe.roles.custom if c.name == slot.role), f"roles.custom.{slot.role}")


def cpu_threads(spec: RoleSpec | CustomRoleSpec, slot: Slot) -> int:
    """The threads of the process's CPU tensor ops (torchrun sets one per process): the role's `threads`,
    else every core this process may run on when the role runs on the CPU (roles that compute on the CPU
    mostly take turns: a role on the CPU that waits for another's rows uses none), else one."""
    if spec.threads:
        return spec.threads
    return 1 if slot.devices else len(os.sched_getaffinity(0))


def import_role(recipe: Recipe, slot: Slot) -> None:
    """Imports the role's module (torchtitan for training: seconds), to overlap the data plane's start. Its
    errors are left for the import in the role's run, which reports them to the run."""
    with contextlib.suppress(Exception):
        role_class(recipe, slot)


def this_slot(recipe: Recipe) -> tuple[Slot, list[Slot], list[Slot]]:
    """This process's slot (from torchrun's environment), the slots on its node, and every slot."""
    node = node_rank(recipe)
    slots = assign(recipe, int(os.environ["WORLD_SIZE"]), gpus_per_node=torch.cuda.device_count())
    here = on_node(slots, node)
    if int(os.environ["LOCAL_WORLD_SIZE"]) != len(here):
        raise SchemaError(
            f"node {node} runs {len(here)} processes of the recipe, but torchrun started "
            f"{os.environ['LOCAL_WORLD_SIZE']} here (--nproc-per-node={len(here)}; meshy check prints each node's)"
        )
    return here[int(os.environ["LOCAL_RANK"])], here, list(slots.values())


def use_devices(recipe: Recipe, slot: Slot) -> None:
    """The slot's CPU threads and GPU (with the role's memory_fraction of it), for this process."""
    spec = dict(recipe.roles.items())[slot.role]
    torch.set_num_threads(cpu_threads(spec, slot))
    if slot.devices:  # "cuda" without an index means the slot's GPU in this process, not GPU 0
        torch.cuda.set_device(slot.device)
        if spec.memory_fraction is not None:
            for device in slot.devices:
                torch.cuda.set_per_process_memory_fraction(spec.memory_fraction, device)


def connect_store(recipe: Recipe) -> dist.TCPStore:
    """torchrun's TCPStore, where the data plane's endpoints are published."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        recipe.world_size,
        is_master=False,
        timeout=timedelta(seconds=600),
    )


def run_role(ctx: RoleContext) -> bool:
    """Build the slot's role and run it to the end of the run; whether it failed. A failure is reported (the
    user's code's as theirs, in logs/task_error.txt) and the run's stop announced."""
    recipe, slot, client = ctx.recipe, ctx.slot, ctx.client
    try:
        cls = role_class(recipe, slot)
        custom = next((c for c in recipe.roles.custom if c.name == slot.role), None)
        role = cls(ctx, **custom.arguments()) if custom is not None else cls(ctx)
        role.run()
    except TaskError as e:  # the user's code: their traceback and the field to fix, not ours
        print(f"meshy: {slot.role} process {slot.index}: {e}", file=sys.stderr, flush=True)
        task_error_file = ctx.run_dir / "logs" / TASK_ERROR_FILE
        if not task_error_file.exists():  # the first one to fail says why the run stopped
            task_error_file.write_text(f"{e}\n")
        with contextlib.suppress(DataPlaneError):
            announce_stop(client, f"{e.field} failed in {slot.role} process {slot.index}")
        return True
    except BaseException:
        traceback.print_exc()
        with contextlib.suppress(DataPlaneError):  # the data plane may be what failed
            announce_stop(client, f"{slot.role} process {slot.index} failed")
        return True
    return False


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
    server = host_servers(recipe, slot, slot is here[0], address, store, secret, directory / "logs", warm_up)
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
