"""What a role process gets from the launcher, and the run-wide conventions every role shares.

Roles meet only through the data plane: the rollout table, the `weights` stream, and the `run` stream,
on which the training role announces the end of the run. Each process appends what it observed to its
own record file in the run directory (`records/<role>-<index>.jsonl`), from which `meshy inspect`
rebuilds the audit.
"""

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshy.dataplane import DataPlaneClient, TableSpec
from meshy.dataplane import rollout as cols
from meshy.dataplane.schema import Column
from meshy.recipes.recipe import Recipe
from meshy.recipes.topology import Slot

RUN_STREAM = "run"
GROUND_TRUTH = "ground_truth"
TRAIN_TASK = "train"


def rollout_table(recipe: Recipe) -> TableSpec:
    """The run's one table: the shared rollout columns plus the task's ground truth (and routed_experts
    when the run replays routing). A row is freed once training (and the critic, and every custom role
    that names its task) acked it."""
    retire_after = (TRAIN_TASK, "critic_train") if recipe.algorithm.kind == "ppo" else (TRAIN_TASK,)
    arch = recipe.model.arch()
    base = cols.rollout_table(
        group_size=recipe.algorithm.group_size,
        teacher_topk=recipe.algorithm.teacher_topk if recipe.algorithm.kind == "distill" else 0,
        routed_experts=(arch.num_hidden_layers, arch.num_experts_per_tok) if recipe.algorithm.routing_replay else None,
        retire_after=retire_after + tuple(c.task for c in recipe.roles.custom if c.task),
    )
    columns = (*base.columns, Column(GROUND_TRUTH, "str"), *recipe.extra_columns)
    return TableSpec(base.name, columns, base.group_size, base.max_row_bytes, base.retire_after)


@dataclass
class RoleContext:
    recipe: Recipe
    slot: Slot
    run_dir: Path
    client: DataPlaneClient
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def table(self) -> str:
        return cols.rollout_table().name

    def record(self, kind: str, **data: Any) -> None:
        """Append one observation to this process's record file."""
        path = self.run_dir / "records" / f"{self.slot.role}-{self.slot.index}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "time": time.time(), **data}) + "\n")

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


def announce_stop(client: DataPlaneClient, reason: str) -> None:
    client.append(RUN_STREAM, {"event": "stop", "reason": reason})
