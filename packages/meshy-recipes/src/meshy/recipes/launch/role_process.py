"""What a role's process does, whoever started it (torchrun's rank, meshy.recipes.launch.rank, or the child a
restarting role runs in, meshy.recipes.launch.restarts): find its slot, take its devices, reach torchrun's
store, build its role and run it."""

import contextlib
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from meshy.dataplane import DataPlaneError, SchemaError
from meshy.recipes.launch.nodes import node_rank
from meshy.recipes.recipe import BUILTIN_ROLES, CustomRoleSpec, Recipe, RoleSpec
from meshy.recipes.recipe.topology import Slot, assign, on_node
from meshy.recipes.roles.context import RoleContext, announce_stop
from meshy.recipes.usercode.imports import import_object
from meshy.recipes.usercode.task_errors import TASK_ERROR_FILE, TaskError


def role_path(recipe: Recipe, slot: Slot) -> str:
    """The role's class, as "package.module:Class"."""
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
        return builtin[slot.role]
    return next(c.cls for c in recipe.roles.custom if c.name == slot.role)


def role_class(recipe: Recipe, slot: Slot) -> type:
    field = f"roles.{slot.role}" if slot.role in BUILTIN_ROLES else f"roles.custom.{slot.role}"
    return import_object(role_path(recipe, slot), field)


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
