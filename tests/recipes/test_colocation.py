"""A ring's members build their device state only while they hold the token: an ON_DEMAND member in a
BUILD turn, inference (the FALLBACK member) once the token has come back to it. Real data plane, each
member on a client of its own."""

import asyncio
import json
import threading
import time
import uuid

import pytest

import meshy.recipes.roles.colocation as colocation
from meshy.dataplane import DataPlaneClient, DataPlaneTimeout
from meshy.recipes.recipe import DEFAULT_RECIPE, load_recipe
from meshy.recipes.recipe.topology import Slot
from meshy.recipes.roles.colocation import BUILD, DeviceTurns, build_holding_token, join_ring
from meshy.recipes.roles.context import RoleContext


@pytest.fixture
def contexts(dataplane, secret, tmp_path):
    """(training, inference) contexts of one training+inference ring of its own (a fresh process index)."""
    (tmp_path / "recipe.toml").write_text('colocate = [["training", "inference"]]\n' + DEFAULT_RECIPE.read_text())
    recipe = load_recipe(tmp_path / "recipe.toml")
    index, ring = uuid.uuid4().int % 10**6, "training+inference"
    with (
        DataPlaneClient(dataplane.endpoints, secret, name="training") as training,
        DataPlaneClient(dataplane.endpoints, secret, name="inference") as inference,
    ):
        yield (
            RoleContext(recipe, Slot(0, "training", index, 1, (), ring), tmp_path, training),
            RoleContext(recipe, Slot(1, "inference", index, 1, (), ring), tmp_path, inference),
        )


def turns_of(ctx: RoleContext) -> list[dict]:
    path = ctx.run_dir / "records" / f"{ctx.slot.role}-{ctx.slot.index}.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "device_turn"]


def test_inference_builds_only_after_the_member_that_asked_first_has_built_and_handed_the_token_back(contexts):
    training_ctx, inference_ctx = contexts
    ring = join_ring(inference_ctx, lambda _: None, lambda: None)  # declared first: inference holds the token
    building, released = threading.Event(), []

    def train() -> None:
        turns = DeviceTurns(training_ctx, lambda _: None, lambda: released.append(time.time()))
        with turns.turn(BUILD):
            building.set()
            time.sleep(0.5)  # training builds its model
        turns.close()

    trainer = threading.Thread(target=train)
    trainer.start()
    while not building.wait(0.05):  # as inference does while it waits for the first weights
        ring.poll()
    built = asyncio.run(build_holding_token(inference_ctx, ring, time.time))
    trainer.join(timeout=30)
    ring.close()

    assert built >= released[0], "the engine was built only after training gave its memory back"
    (trained,), (inferred,) = turns_of(training_ctx), turns_of(inference_ctx)
    assert trained["what"] == inferred["what"] == BUILD
    assert inferred["seq"] > trained["seq"] and inferred["start"] >= trained["end"]


def test_inference_waiting_for_the_token_to_build_stops_with_the_run_or_says_who_keeps_it(contexts, monkeypatch):
    training_ctx, inference_ctx = contexts
    ring = join_ring(inference_ctx, lambda _: None, lambda: None)
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:  # training takes the token and keeps it past the waits below
        turns = DeviceTurns(training_ctx, lambda _: None, lambda: None)
        with turns.turn(BUILD):
            holding.set()
            done.wait(30)
        turns.close()

    holder = threading.Thread(target=hold)
    holder.start()
    while not holding.wait(0.05):
        ring.poll()
    monkeypatch.setattr(colocation, "TURN_TIMEOUT_S", 0.5)
    with pytest.raises(DataPlaneTimeout, match=r"'inference' did not get the token back within 0.5s to build its"):
        asyncio.run(build_holding_token(inference_ctx, ring, time.time))

    threading.Timer(0.3, inference_ctx.stop.set).start()
    monkeypatch.setattr(colocation, "TURN_TIMEOUT_S", 30.0)
    assert asyncio.run(build_holding_token(inference_ctx, ring, time.time)) is None, "nothing built once stopped"
    done.set()
    holder.join(timeout=30)
    ring.close()
