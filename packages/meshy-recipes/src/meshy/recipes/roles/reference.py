"""The reference role: the frozen initial policy (meshy.recipes.roles.reference_weights) scores every response
into ref_logprobs, for the KL term of the loss (algorithm.loss.kl_coef), on the engine the recipe names
(`sampling.engine`), like the teacher role; colocated, only in its turns on the ring's devices."""

import asyncio

from meshy.infer.reference_service import ReferenceService, ReferenceServiceConfig
from meshy.recipes.roles.colocation import engine_turns, step_burst
from meshy.recipes.roles.context import RoleContext
from meshy.recipes.roles.engines import build_engine
from meshy.recipes.roles.reference_weights import wait_for_reference


class ReferenceRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx

    def run(self) -> None:
        self.ctx.watch_for_stop()
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        ctx = self.ctx
        published = await asyncio.to_thread(wait_for_reference, ctx)
        if published is None:
            return
        colocated = ctx.slot.ring is not None
        engine, turns = await engine_turns(ctx, lambda: build_engine(ctx, published, colocate=colocated))
        rows, wait_s = step_burst(ctx)
        config = ReferenceServiceConfig(
            table=ctx.table,
            rows_per_lease=max(rows, ReferenceServiceConfig.rows_per_lease),
            burst_rows=rows,
            burst_wait_s=wait_s,
        )
        service = ReferenceService(ctx.client, engine, config, device_turn=turns.turn_async)
        try:
            await ctx.until_stopped(service.run)
            await asyncio.to_thread(turns.close)
        finally:
            await engine.close()
        ctx.record(
            "reference", version=published.version, device=ctx.slot.device, rows=service.rows, unscored=service.unscored
        )
