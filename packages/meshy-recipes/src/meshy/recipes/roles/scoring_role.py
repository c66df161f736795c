"""The shape the roles that score responses share (teacher, reference): a ScoringService of meshy.infer
on the engine the recipe names (`sampling.engine`), served until the run stops; colocated, only in its
turns on the ring's devices. Each role's module says with which weights it scores, by which service,
and what its last record adds to the rows scored."""

import abc
import asyncio
from typing import Any, Generic, TypeVar

from meshy.dataplane.model_source import ModelSource
from meshy.infer.response_scoring import ScoringConfig, ScoringService
from meshy.recipes.roles.colocation import engine_turns, step_burst
from meshy.recipes.roles.context import RecordKind, RoleContext
from meshy.recipes.roles.engines import build_engine

Weights = TypeVar("Weights", bound=ModelSource)


class ScoringRole(abc.ABC, Generic[Weights]):
    service_type: type[ScoringService]
    config_type: type[ScoringConfig]
    kind: RecordKind  # of the role's last record

    def __init__(self, ctx: RoleContext):
        self.ctx = ctx

    def run(self) -> None:
        self.ctx.watch_for_stop()
        asyncio.run(self._serve())

    @abc.abstractmethod
    async def weights(self) -> Weights | None:
        """The weights the role scores with, or None if the run stops first."""

    def options(self) -> dict[str, Any]:
        """The service's settings of the role's own (its config_type's fields beyond table and lease)."""
        return {}

    def summary(self, weights: Weights) -> dict[str, Any]:
        """What the role's last record says besides the rows it scored and those it could not."""
        return {}

    async def _serve(self) -> None:
        ctx = self.ctx
        weights = await self.weights()
        if weights is None:
            return
        colocated = ctx.slot.ring is not None
        engine, turns = await engine_turns(ctx, lambda: build_engine(ctx, weights, colocate=colocated))
        rows, wait_s = step_burst(ctx)
        config = self.config_type(
            table=ctx.table,
            rows_per_lease=max(rows, self.config_type.rows_per_lease),
            burst_rows=rows,
            burst_wait_s=wait_s,
            **self.options(),
        )
        service = self.service_type(ctx.client, engine, config, device_turn=turns.turn_async)
        try:
            await ctx.until_stopped(service.run)
            await asyncio.to_thread(turns.close)
        finally:
            await engine.close()
        ctx.record(self.kind, **self.summary(weights), rows=service.rows, unscored=service.unscored)
