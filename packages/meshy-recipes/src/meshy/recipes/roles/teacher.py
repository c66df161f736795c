"""The teacher role (online policy distillation): a fixed teacher model scores every response."""

import asyncio

from meshy.infer.teacher_service import TeacherService, TeacherServiceConfig
from meshy.infer.torch_engine import TorchEngine
from meshy.recipes.context import RoleContext
from meshy.recipes.pretrained import resolve


class TeacherRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx

    def run(self) -> None:
        self.ctx.watch_for_stop()
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        ctx, recipe = self.ctx, self.ctx.recipe
        engine = TorchEngine(
            resolve(recipe.model.teacher),
            max_running=recipe.sampling.max_in_flight,
            max_len=recipe.sampling.context_length,
            device=ctx.slot.device,
        )
        service = TeacherService(
            ctx.client, engine, TeacherServiceConfig(table=ctx.table, top_k=recipe.algorithm.teacher_topk)
        )
        stop = asyncio.Event()
        serving = asyncio.create_task(service.run(stop))
        while not ctx.stop.is_set() and not serving.done():
            await asyncio.sleep(0.2)
        stop.set()
        await serving
        await engine.close()
        ctx.record("teacher", rows=service.rows, unscored=service.unscored)
