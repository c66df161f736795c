"""The roles that score responses (teacher, reference) are one shape, meshy.recipes.roles.scoring_role: an
engine built on the role's weights, its service configured from the recipe and the role's own options and
served until the run stops, then the role's last record."""

import json
import time

from meshy.infer.teacher_service import TeacherServiceConfig
from meshy.recipes.recipe import load_recipe
from meshy.recipes.recipe.topology import assign
from meshy.recipes.roles import scoring_role
from meshy.recipes.roles.context import RecordKind, RoleContext
from meshy.recipes.roles.reference import ReferenceRole
from meshy.recipes.roles.scoring_role import ScoringRole
from meshy.recipes.roles.teacher import TeacherRole


class QuietRunStream:
    """The `run` stream of a run that has not stopped: nothing to read."""

    def reader(self, *args, **kwargs) -> "QuietRunStream":
        return self

    def read(self, timeout: float = 0.0) -> list:
        time.sleep(timeout)
        return []


class Engine:
    def __init__(self, source: str):
        self.source, self.closed = source, False

    async def close(self) -> None:
        self.closed = True


class Service:
    """A scoring service that scores 5 rows, cannot score 1, and ends."""

    served: "Service | None" = None

    def __init__(self, client, engine: Engine, config: TeacherServiceConfig, device_turn):
        self.engine, self.config, self.rows, self.unscored = engine, config, 5, 1
        Service.served = self

    async def run(self, stop) -> None:
        return None


class Scorer(ScoringRole[str]):
    service_type = Service
    config_type = TeacherServiceConfig
    kind = RecordKind.TEACHER

    def __init__(self, ctx: RoleContext, weights: str | None):
        super().__init__(ctx)
        self.source = weights

    async def weights(self) -> str | None:
        return self.source

    def options(self) -> dict:
        return {"top_k": 3}

    def summary(self, weights: str) -> dict:
        return {"weights": weights}


def context(tmp_path) -> RoleContext:
    recipe = load_recipe()
    return RoleContext(recipe, assign(recipe, recipe.world_size)[0], tmp_path, client=QuietRunStream())


def records(ctx: RoleContext) -> list[dict]:
    path = ctx.run_dir / "records" / f"{ctx.slot.role}-{ctx.slot.index}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_a_scoring_role_serves_its_service_on_an_engine_built_on_its_weights_then_records(monkeypatch, tmp_path):
    monkeypatch.setattr(scoring_role, "build_engine", lambda ctx, source, colocate: Engine(source))
    ctx = context(tmp_path)
    try:
        Scorer(ctx, "teacher-weights").run()
    finally:
        ctx.stop.set()  # ends the stop-watch thread
    service = Service.served
    assert service.engine.source == "teacher-weights" and service.engine.closed
    assert service.config == TeacherServiceConfig(table=ctx.table, top_k=3), "not colocated: any row at once"
    (record,) = records(ctx)
    assert {k: v for k, v in record.items() if k != "time"} == {
        "kind": "teacher",
        "weights": "teacher-weights",
        "rows": 5,
        "unscored": 1,
    }


def test_a_scoring_role_whose_run_stops_before_its_weights_come_builds_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(scoring_role, "build_engine", lambda *args, **kwargs: 1 / 0)
    ctx = context(tmp_path)
    try:
        Scorer(ctx, None).run()
    finally:
        ctx.stop.set()
    assert records(ctx) == []


def test_the_teacher_and_the_reference_are_scoring_roles_of_their_own_service_and_record():
    assert issubclass(TeacherRole, ScoringRole) and issubclass(ReferenceRole, ScoringRole)
    assert (TeacherRole.kind, ReferenceRole.kind) == (RecordKind.TEACHER, RecordKind.REFERENCE)
    assert TeacherRole.service_type.declared != ReferenceRole.service_type.declared
