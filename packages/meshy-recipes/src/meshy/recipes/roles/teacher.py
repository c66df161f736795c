"""The teacher role (online policy distillation): a fixed teacher model scores every response, on the
engine the recipe names (`sampling.engine`), like the inference role; colocated, only in its turns on the
ring's devices."""

import asyncio

from meshy.infer.teacher_service import TeacherService, TeacherServiceConfig
from meshy.recipes.roles.colocation import engine_turns, step_burst
from meshy.recipes.roles.context import RoleContext
from meshy.recipes.roles.engines import build_engine
from meshy.recipes.weights.pretrained import resolve


class TeacherRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx

    def run(self) -> None:
        self.ctx.watch_for_stop()
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        ctx, recipe = self.ctx, self.ctx.recipe
        teacher, colocated = resolve(recipe.model.teacher), ctx.slot.ring is not None
        engine, turns = await engine_turns(ctx, lambda: build_engine(ctx, teacher, colocate=colocated))
        rows, wait_s = step_burst(ctx)
        config = TeacherServiceConfig(
            table=ctx.table,
            top_k=recipe.algorithm.teacher_topk,
            rows_per_lease=max(rows, TeacherServiceConfig.rows_per_lease),
            burst_rows=rows,
            burst_wait_s=wait_s,
        )
        service = TeacherService(ctx.client, engine, config, device_turn=turns.turn_async)
        try:
            await ctx.until_stopped(service.run)
            await asyncio.to_thread(turns.close)
        finally:
            await engine.close()
        ctx.record("teacher", rows=service.rows, unscored=service.unscored)
