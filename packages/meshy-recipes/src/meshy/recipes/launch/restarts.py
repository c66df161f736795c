"""Roles that restart in place: a process of a role with `max_restarts` runs the role in a child of its own
and starts it again when a signal kills it (SIGKILL, the OOM killer), while the rest of the run goes on.

The rank process (torchrun's) keeps what outlives the role: its slot, the data-plane servers it may host,
torchrun's end-of-run handshake. Children fork from a server process that imported torch and the role's
module once, so a restart costs a fork, not a new interpreter's imports. The child connects to the data
plane anew and builds the role from the recipe; the rows its predecessor held go back to the pool as it
starts (their leases, short and renewed while the rows are generated, would run out soon anyway), and an
engine built anew starts from the newest version announced.
A child that fails by itself (an exception: a bug, not bad luck) stops the run as any process does, and so
does a kill past `max_restarts`.
"""

import multiprocessing
import os
import signal
import sys
from multiprocessing.connection import Connection

import torch

from meshy.dataplane import DataPlaneClient, Endpoints, secret_from_env
from meshy.recipes.launch.nodes import run_dir
from meshy.recipes.launch.parent_death import die_with_parent
from meshy.recipes.launch.role_process import connect_store, role_path, run_role, this_slot, use_devices
from meshy.recipes.recipe import load_recipe
from meshy.recipes.recipe.dataflow import tables
from meshy.recipes.roles.context import RUN_STREAM, RecordKind, RoleContext, announce_stop

# The lease a restartable process takes rows under (its service renews it every third of it, however long a
# generation takes): the longest that rows of a dead process wait, should its supervisor not release them.
RESTARTABLE_LEASE_S = 30.0


def supervise(ctx: RoleContext, recipe_path: str | None, max_restarts: int) -> bool:
    """Runs the slot's role in a child process, started again each time a signal kills it, up to
    `max_restarts` times; whether the role failed (a child's error, or a kill past the restarts)."""
    role, index = ctx.slot.role, ctx.slot.index
    # Children fork from a server process of their own, which imported torch and the role once: no threads or
    # CUDA state of this process, and a restart does not import them again (seconds, most of its cost).
    forks = multiprocessing.get_context("forkserver")
    forks.set_forkserver_preload([__name__, role_path(ctx.recipe, ctx.slot).split(":")[0]])
    for attempt in range(max_restarts + 1):
        consumer, told = forks.Pipe(duplex=False)  # the child's data-plane consumer id, once it has one
        child = forks.Process(target=child_main, args=(recipe_path, attempt, told), name=f"meshy-{role}-{index}")
        child.start()
        told.close()
        child.join()
        if child.exitcode >= 0:
            return child.exitcode != 0  # ended with the run, or failed (it reported why and announced the stop)
        killed_by = signal.Signals(-child.exitcode).name
        if _run_stopped(ctx):
            return False  # killed as the run stops: whatever stopped it is what the run reports
        if attempt == max_restarts:
            reason = f"{role} process {index} was killed by {killed_by}, past its max_restarts = {max_restarts}"
            print(f"meshy: {reason}", file=sys.stderr, flush=True)
            announce_stop(ctx.client, reason)
            return True
        released = _release_leases(ctx, consumer)
        ctx.record(
            RecordKind.RESTART,
            pid=child.pid,
            signal=killed_by,
            restart=attempt + 1,
            max_restarts=max_restarts,
            released=released,
        )
        print(
            f"meshy: {role} process {index} (pid {child.pid}) was killed by {killed_by}; starting it again "
            f"(restart {attempt + 1} of {max_restarts}), the run goes on",
            file=sys.stderr,
            flush=True,
        )
    raise AssertionError("unreachable: the last attempt returns")


def _release_leases(ctx: RoleContext, consumer: Connection) -> int:
    """Returns the rows a dead child held to the pool now (instead of when their leases run out); how many."""
    if not consumer.poll():
        return 0  # it died before connecting: it held nothing
    consumer_id = consumer.recv()
    return sum(ctx.client.release_consumer(spec.name, consumer_id) for spec in tables(ctx.recipe))


def _run_stopped(ctx: RoleContext) -> bool:
    """Whether the run's stop has been announced (on the `run` stream)."""
    reader = ctx.client.reader(RUN_STREAM, f"{ctx.slot.role}-{ctx.slot.index}-restarts", start=1)
    try:
        return any(message.payload.get("event") == "stop" for message in reader.read(timeout=0.0))
    finally:
        reader.close()


def child_main(recipe_path: str | None, attempt: int, told: Connection) -> None:
    """The role's process: connects to the run's data plane as its rank did, runs the role, exits 1 if the
    role failed."""
    die_with_parent()
    recipe = load_recipe(recipe_path)
    slot, _, _ = this_slot(recipe)
    use_devices(recipe, slot)
    endpoints = Endpoints.from_store(connect_store(recipe))
    name = f"{slot.role}{slot.index}"
    client = DataPlaneClient(endpoints, secret_from_env(), recipe.dataplane, name=name, node=slot.node)
    told.send(client.consumer_id)
    told.close()
    ctx = RoleContext(recipe, slot, run_dir(recipe), client)
    threads = torch.get_num_threads()
    ctx.record(RecordKind.START, rank=slot.rank, node=slot.node, pid=os.getpid(), attempt=attempt, threads=threads)
    failed = run_role(ctx)
    ctx.record_traffic(client.storage_bytes(), endpoints.storage_nodes)
    client.close()
    sys.exit(1 if failed else 0)
