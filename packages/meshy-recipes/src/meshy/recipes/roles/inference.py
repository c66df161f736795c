"""The inference role: a generation engine behind the inference service, loading each new version."""

import asyncio

from meshy.dataplane.model_source import ModelSource
from meshy.dataplane.weights import COLLECTIVE, WEIGHTS_STREAM, Published
from meshy.infer.inference_service import InferenceService, InferenceServiceConfig, InferenceStats
from meshy.recipes.colocation import join_ring, record_released
from meshy.recipes.context import RoleContext
from meshy.recipes.dataflow import TURNS
from meshy.recipes.engines import build_engine


class InferenceRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx

    def run(self) -> None:
        self.ctx.watch_for_stop()
        asyncio.run(self._serve())

    def _first_weights(self) -> tuple[int, ModelSource] | None:
        """The first version announced, and where to read it; a broadcast version is received here (every
        broadcast is joined, in order: the publisher waits for every engine)."""
        reader = self.ctx.client.reader(WEIGHTS_STREAM, f"inference-{self.ctx.slot.index}-start", start=1)
        try:
            while not self.ctx.stop.is_set():
                messages = reader.read(max_n=1024, timeout=1.0)
                for message in messages:
                    published = Published.from_message(message.payload)
                    collective = published.format == COLLECTIVE
                    source = self.ctx.weight_sync.receive(published) if collective else published
                if messages:
                    return published.version, source
            return None
        finally:
            reader.close()

    async def _share_devices(self, engine, stop: asyncio.Event) -> None:
        """As the ring's FALLBACK member: hand the devices over when asked (pause, release memory) and
        take them back when the token returns (onload, resume)."""
        loop = asyncio.get_running_loop()

        def run(coroutine) -> None:
            asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=120)

        async def give() -> None:
            await engine.pause()
            await engine.release()
            record_released(self.ctx)

        async def take() -> None:
            await engine.onload()
            await engine.resume()

        ring = await asyncio.to_thread(join_ring, self.ctx, lambda _: run(take()), lambda: run(give()))
        if ring is None:
            return
        while not stop.is_set():
            await asyncio.to_thread(ring.poll, 0.2)
        await asyncio.to_thread(ring.close)

    async def _serve(self) -> None:
        ctx, sampling = self.ctx, self.ctx.recipe.sampling
        first = await asyncio.to_thread(self._first_weights)
        if first is None:
            return
        version, source = first
        engine = build_engine(ctx, source, colocate=ctx.slot.ring is not None, version=version)
        multi_turn = ctx.recipe.multi_turn
        config = InferenceServiceConfig(
            table=TURNS if multi_turn else ctx.table,
            max_in_flight=sampling.max_in_flight,
            max_new_tokens=sampling.max_new_tokens,
            context_length=sampling.context_length,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=ctx.recipe.seed * 1000 + ctx.slot.index,
            # Lock-step with the pure-torch engine replays token for token when batches do not hang on timing.
            # (Turns of multi-turn trajectories arrive as tools answer: waves would make each wait for the others.)
            waves=ctx.recipe.algorithm.window == 1 and sampling.engine == "torch" and not multi_turn,
        )
        service = InferenceService(ctx.client, engine, config, weight_sync=ctx.weight_sync)

        async def serve(stop: asyncio.Event) -> InferenceStats:
            sharing = asyncio.create_task(self._share_devices(engine, stop))
            try:
                return await service.run(stop)
            finally:
                stop.set()  # the ring member stops with the service, however it ended
                await sharing

        try:
            stats = await ctx.until_stopped(serve)
        finally:
            await engine.close()
        ctx.record(
            "inference",
            rows=stats.rows,
            errors=stats.errors,
            tokens=stats.tokens,
            weight_updates=stats.weight_updates,
            continued=stats.continued,
            versions=stats.versions,
            busy_s=stats.busy_s,
            failed_loads=stats.failed_loads,
        )
