"""The inference role: a generation engine behind the inference service, loading each new version."""

import asyncio
import dataclasses

import torch

from meshy.dataplane import GpuTokenRing
from meshy.dataplane.adapters import Adapter, is_adapter_tensor
from meshy.dataplane.model_source import ModelSource
from meshy.dataplane.weights import WEIGHTS_STREAM, Published, Transport
from meshy.infer.engine import Engine
from meshy.infer.inference_service import InferenceService, InferenceServiceConfig, InferenceStats
from meshy.recipes.launch.restarts import RESTARTABLE_LEASE_S
from meshy.recipes.launch.startup import phase_done
from meshy.recipes.recipe.dataflow import PARTIALS, TURNS
from meshy.recipes.roles.colocation import POLL_S, build_holding_token, join_ring, record_released
from meshy.recipes.roles.context import RecordKind, RoleContext
from meshy.recipes.roles.engines import build_engine


class InferenceRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        self.engine: Engine | None = None  # built once the first weights are announced

    def run(self) -> None:
        self.ctx.watch_for_stop()
        asyncio.run(self._serve())

    def _first_weights(self, ring: GpuTokenRing | None) -> tuple[int, ModelSource, Adapter | None] | None:
        """The first version announced, where to read it and its adapters (a LoRA version's); a broadcast
        version is received here (every broadcast is joined, in order: the publisher waits for every engine).
        Colocated, the token goes on meanwhile to every member that asks for it (training builds and publishes
        in its turns)."""
        reader = self.ctx.client.reader(WEIGHTS_STREAM, f"inference-{self.ctx.slot.index}-start", start=1)
        try:
            while not self.ctx.stop.is_set():
                if ring is not None:
                    ring.poll()
                messages = reader.read(max_n=1024, timeout=POLL_S)
                base: dict[str, torch.Tensor] = {}  # a broadcast LoRA base received with an earlier version
                for message in messages:
                    published = Published.from_message(message.payload)
                    collective = published.transport is Transport.COLLECTIVE
                    # (with SGLang, the engine joins and receives it itself, once built from the announcement)
                    source = published
                    if collective and self.ctx.weight_sync is not None:
                        source, base = self._receive(published, base)
                if messages:
                    return published.version, source, published.adapter
            return None
        finally:
            reader.close()

    def _receive(
        self, published: Published, base: dict[str, torch.Tensor]
    ) -> tuple[tuple[dict, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """A broadcast version received whole, and the LoRA base it carries or that an earlier one carried
        (a version after the first carries its adapters only: they are added to that base)."""
        held = published.adapter.base if published.adapter is not None and base else None
        config, tensors = self.ctx.weight_sync.receive(published, held_base=held)
        if published.adapter is None:
            return (config, tensors), {}
        adapters = {name: tensor for name, tensor in tensors.items() if is_adapter_tensor(name)}
        base = {name: tensor for name, tensor in tensors.items() if name not in adapters} or base
        return (config, {**base, **adapters}), base

    async def _join_ring(self) -> GpuTokenRing | None:
        """As the ring's FALLBACK member: hand the devices over when asked (pause, release memory) and
        take them back when the token returns (onload, resume); until the engine is built, there is
        nothing to hand over."""
        loop = asyncio.get_running_loop()

        def run(coroutine) -> None:
            asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=120)

        async def give() -> None:
            if self.engine is not None:
                await self.engine.pause()
                await self.engine.release()
                record_released(self.ctx)

        async def take() -> None:
            if self.engine is not None:
                await self.engine.onload()
                await self.engine.resume()

        return await asyncio.to_thread(join_ring, self.ctx, lambda _: run(take()), lambda: run(give()))

    @staticmethod
    async def _share_devices(ring: GpuTokenRing, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(ring.poll, POLL_S)

    async def _serve(self) -> None:
        ring = await self._join_ring()
        try:
            stats = await self._serve_in(ring)
        finally:
            if ring is not None:  # the token goes on while the engine can still give its memory back
                await asyncio.to_thread(ring.close)
            if self.engine is not None:
                await self.engine.close()
        if stats is not None:
            self.ctx.record(RecordKind.INFERENCE, **dataclasses.asdict(stats))

    async def _serve_in(self, ring: GpuTokenRing | None) -> InferenceStats | None:
        """Serve until the run stops: its statistics, or None if it stopped before the engine was built."""
        ctx, sampling = self.ctx, self.ctx.recipe.sampling
        first = await asyncio.to_thread(self._first_weights, ring)
        if first is None:
            return None
        version, source, adapter = first
        colocated = ctx.slot.ring is not None
        replay = ctx.recipe.algorithm.routing_replay

        def build() -> Engine:
            return build_engine(
                ctx, source, colocate=colocated, version=version, record_routing=replay, adapter=adapter
            )

        self.engine = await build_holding_token(ctx, ring, build)
        if self.engine is None:
            return None
        if ctx.slot.index == 0:
            phase_done("inference engine built")
        engine = self.engine
        multi_turn = ctx.recipe.multi_turn
        config = InferenceServiceConfig(
            table=TURNS if multi_turn else ctx.table,
            sampling=sampling.params(seed=ctx.recipe.seed * 1000 + ctx.slot.index),
            max_in_flight=sampling.max_in_flight,
            context_length=sampling.context_length,
            # Lock-step with the pure-torch engine replays token for token when batches do not hang on timing.
            # (Turns of multi-turn trajectories arrive as tools answer: waves would make each wait for the others.)
            # (Chunks of responses kept as they go are requests of their own, posted as each chunk is written.)
            waves=ctx.recipe.algorithm.window == 1
            and sampling.engine == "torch"
            and not multi_turn
            and not sampling.keep_partial_every,
            # restarting in place, a process's rows come back soon after it dies (renewed while it lives)
            lease_s=RESTARTABLE_LEASE_S if ctx.recipe.roles.inference.max_restarts else InferenceServiceConfig.lease_s,
            partials_table=PARTIALS if sampling.keep_partial_every else None,
            partial_every=sampling.keep_partial_every,
        )
        service = InferenceService(ctx.client, engine, config, weight_sync=ctx.weight_sync)

        async def serve(stop: asyncio.Event) -> InferenceStats:
            sharing = asyncio.create_task(self._share_devices(ring, stop)) if ring is not None else None
            try:
                return await service.run(stop)
            finally:
                stop.set()  # the ring member stops with the service, however it ended
                if sharing is not None:
                    await sharing

        return await ctx.until_stopped(serve)
