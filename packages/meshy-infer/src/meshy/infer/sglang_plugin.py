"""Meshy's SGLang plugin, which every SGLang process loads through the `sglang.srt.plugins` entry point: a
scheduler receives a version that Meshy broadcasts on SGLang's own weights update group, and verifies
its checksum, before SGLang loads any of it. (SGLang's own receive hands each bucket to the model as it
arrives, so a torn or corrupt version would be half loaded with nothing to go back to.)

A request to update weights from distributed made of `receive_request(published)` carries the version's
announcement; every other request is SGLang's own, untouched. The tensors are received into
host buffers that the scheduler keeps from version to version (they hold the base a delta applies to).
"""

import json
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from meshy.dataplane import SchemaError
from meshy.dataplane.weight_sync import WeightSyncGroup
from meshy.dataplane.weights import CorruptWeights, Published

RECEIVE = (
    "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.receive_weights_from_distributed"
)
ENTRY_POINT_GROUP, NAME = "sglang.srt.plugins", "meshy"  # as packages/meshy-infer/pyproject.toml names it
_PREFIX = "meshy-broadcast:"
NOT_VERIFIED = "meshy: not loaded: "  # starts the message of a version that failed its checks
# This process's membership of each group it received on, by the group's id (the group kept with it).
_members: dict[int, tuple[object, WeightSyncGroup]] = {}


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(RECEIVE, receive_broadcast, HookType.AROUND)


def receive_request(published: Published) -> dict[str, Any]:
    """The fields of an update-weights-from-distributed request that asks a scheduler to receive
    `published`. Without this plugin SGLang fails it, naming the plugin, instead of loading nothing."""
    return {
        "names": ["meshy"],
        "dtypes": ["missing_meshy_sglang_plugin"],  # SGLang's own receive: torch has no such dtype
        "shapes": [[0]],
        "load_format": _PREFIX + json.dumps(published.to_message()),
    }


def check_loaded() -> None:
    """SchemaError unless SGLang's processes started from this environment will load this plugin."""
    names = {entry.name for entry in entry_points(group=ENTRY_POINT_GROUP)}
    allowed = os.environ.get("SGLANG_PLUGINS")
    if NAME not in names or (allowed and NAME not in {n.strip() for n in allowed.split(",")}):
        raise SchemaError(
            f"SGLangEngine weight_sync_rank: receiving broadcast versions needs Meshy's SGLang plugin, entry "
            f"point {NAME!r} of {ENTRY_POINT_GROUP!r}: install meshy-infer (uv sync), and if SGLANG_PLUGINS "
            f"is set ({allowed!r}), name {NAME!r} in it"
        )


def receive_broadcast(original: Callable, updater: Any, **request: Any) -> list:
    announced = request.get("load_format") or ""
    if not announced.startswith(_PREFIX):
        return original(updater, **request)
    published = Published.from_message(json.loads(announced.removeprefix(_PREFIX)))
    group = updater._model_update_group[request["group_name"]]
    if id(group) not in _members:
        _members[id(group)] = (group, WeightSyncGroup.over(group))
    try:
        _, tensors = _members[id(group)][1].receive(published)
    except CorruptWeights as e:  # SGLang reports it as the receive's failure, having loaded nothing
        raise CorruptWeights(NOT_VERIFIED + str(e)) from None
    return list(tensors.items())
