"""What a role process gets from the launcher, and the run-wide conventions every role shares.

Roles meet only through the data plane: the rollout table, the `weights` stream, and the `run` stream,
on which the training role announces the end of the run. Each process appends what it observed to its
own record file in the run directory (`records/<role>-<index>.jsonl`), from which `meshy inspect`
rebuilds the audit, and at its end the bytes its data-plane client moved (`records/dataplane/`).
"""

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from meshy.dataplane import DataPlaneClient
from meshy.dataplane import columns as cols
from meshy.dataplane.weight_sync import WeightSyncGroup
from meshy.recipes.recipe import Recipe
from meshy.recipes.recipe.topology import Slot

RUN_STREAM = "run"
# The rows a resumed run's rollout role must not write again, kept from the stopped run or trained before its
# checkpoint (meshy.recipes.launch.kept_rows): one message, {"rows": [ids]}, appended before any role starts.
KEPT_ROWS_STREAM = "kept_rows"
TRAFFIC_DIR = "dataplane"  # under records/: each process's bytes to and from each storage unit
T = TypeVar("T")


class RecordKind(StrEnum):
    """What a record is (its `kind`), for each kind the built-in roles write (RoleContext.record)."""

    START = "start"  # every process, as it starts (launch.rank; a restartable role's child: launch.restarts)
    RESTART = "restart"  # a restartable role's process, killed, started again (launch.restarts)
    KEPT_ROWS = "kept_rows"  # a resumed run's rows read back from disk: kept and dropped (launch.kept_rows)
    ENGINE = "engine"  # the engine a process built (roles.engines)
    GRANT = "grant"  # a colocated process took its ring's token (roles.colocation)
    DEVICE_TURN = "device_turn"  # a colocated process's turn on its ring's devices, once over
    RELEASED = "released"  # what a colocated process kept on its GPU after handing the token on
    TRAIN_START = "train_start"
    VERSION = "version"  # a version trained
    FINAL = "final"  # the final weights, written
    BATCH = "batch"  # rollout wrote a training step's batch
    ADVANTAGE = "advantage"  # rollout's advantages for a batch
    TASK_ERRORS = "task_errors"  # rows rollout dropped on the task's errors (on_task_error = "drop")
    TRAJECTORY = "trajectory"  # a multi-turn row the environment role played to its end
    EVAL = "eval"  # a version evaluated on the held-out problems
    EVAL_SKIPPED = "eval_skipped"  # a version overtaken by a newer one before it was evaluated
    CRITIC_START = "critic_start"
    CRITIC_STEP = "critic_step"
    CRITIC_CHECKPOINT = "critic_checkpoint"
    # each role's last record, named after it: what it did in all
    INFERENCE = "inference"
    ENVIRONMENT = "environment"
    CRITIC = "critic"
    REFERENCE = "reference"
    TEACHER = "teacher"


@dataclass
class RoleContext:
    recipe: Recipe
    slot: Slot
    run_dir: Path
    client: DataPlaneClient
    weight_sync: WeightSyncGroup | None = None  # a member's place in the weight-sync group (collective)
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def table(self) -> str:
        return cols.rollout_table().name

    def record(self, kind: RecordKind | str, **data: Any) -> None:
        """Append one observation to this process's record file (a custom role may name its own kinds)."""
        path = self.run_dir / "records" / f"{self.slot.role}-{self.slot.index}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "time": time.time(), **data}) + "\n")

    def record_traffic(self, moved: dict[str, list[int]], storage_nodes: tuple[int, ...]) -> None:
        """Append the bytes this process's client moved to and from each storage unit (whose nodes are
        `storage_nodes`) to records/dataplane/ (apart from the role's own records, whose last line is the
        role's final state)."""
        path = self.run_dir / "records" / TRAFFIC_DIR / f"{self.slot.role}-{self.slot.index}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        line = {"time": time.time(), "node": self.slot.node, "storage_nodes": list(storage_nodes), **moved}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def watch_for_stop(self) -> threading.Thread:
        """Set `stop` when the `run` stream says the run is over (a background thread)."""
        reader = self.client.reader(RUN_STREAM, f"{self.slot.role}-{self.slot.index}-stop", start=1)

        def watch() -> None:
            while not self.stop.is_set():
                if any(m.payload.get("event") == "stop" for m in reader.read(timeout=1.0)):
                    self.stop.set()

        thread = threading.Thread(target=watch, name="meshy-stop-watch", daemon=True)
        thread.start()
        return thread

    async def until_stopped(self, serve: Callable[[asyncio.Event], Awaitable[T]]) -> T:
        """Run an asyncio service, `serve(stop)`, until the run stops: `stop` (a flag threads set) becomes
        the asyncio event the service watches. Returns what the service returned, when it ends on its own
        or once it has finished after the stop."""
        stop = asyncio.Event()
        serving = asyncio.ensure_future(serve(stop))
        while not self.stop.is_set() and not serving.done():
            await asyncio.wait([serving], timeout=0.2)
        stop.set()
        return await serving


def announce_stop(client: DataPlaneClient, reason: str) -> None:
    client.append(RUN_STREAM, {"event": "stop", "reason": reason})
