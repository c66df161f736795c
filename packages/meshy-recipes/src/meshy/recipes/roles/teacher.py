"""The teacher role (online policy distillation): a fixed teacher model scores every response, on the
engine the recipe names (`sampling.engine`), like the inference role."""

import asyncio

from meshy.infer.teacher_service import TeacherService, TeacherServiceConfig
from meshy.recipes.context import RoleContext
from meshy.recipes.engines import build_engine
from meshy.recipes.pretrained import resolve


class TeacherRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx

    def run(self) -> None:
        self.ctx.watch_for_stop()
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        ctx, recipe = self.ctx, self.ctx.recipe
        engine = build_engine(ctx, resolve(recipe.model.teacher))
        service = TeacherService(
            ctx.client, engine, TeacherServiceConfig(table=ctx.table, top_k=recipe.algorithm.teacher_topk)
        )
        try:
            await ctx.until_stopped(service.run)
        finally:
            await engine.close()
        ctx.record("teacher", rows=service.rows, unscored=service.unscored)
