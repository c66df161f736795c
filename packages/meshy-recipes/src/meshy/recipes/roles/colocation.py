"""Colocated roles share devices through a GPU token ring: the i-th process of each role in a ring
shares ring `<roles>-<i>`. Inference is the FALLBACK member (it generates whenever nobody else needs the
devices); the others are ON_DEMAND: each burst of their compute is a turn (DeviceTurns), for which they
take the token and their state onto the devices, and after which they give both back. A member that does
not hold the token holds no device memory, from the start: each builds its state on the devices in a turn
of its own (a "build" turn), the inference engine once it holds the token (build_holding_token)."""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from meshy.dataplane import FALLBACK, ON_DEMAND, DataPlaneTimeout, GpuTokenRing, Grant
from meshy.infer.engine import Engine
from meshy.recipes.roles.context import RecordKind, RoleContext

BUILD, COMPUTE = "build", "compute"  # what a turn is for (its `device_turn` record says)
TURN_TIMEOUT_S = 600.0  # an ON_DEMAND member waiting longer for the token stops the run, naming its holder
BURST_WAIT_S = 2.0  # how long a colocated consumer waits for a training step's rows before taking fewer
POLL_S = 0.2  # how often the FALLBACK member looks whether another member waits for the devices

T = TypeVar("T")


def join_ring(ctx: RoleContext, on_acquire, on_release) -> GpuTokenRing | None:
    """This process's handle on its ring, or None if its role is not colocated. Each grant it takes is
    recorded, with the bytes free on its GPU as it takes it (before on_acquire moves anything there)."""
    ring = next((r for r in ctx.recipe.colocate if ctx.slot.role in r), None)
    if ring is None:
        return None
    members = [(role, FALLBACK if role == "inference" else ON_DEMAND) for role in ring]

    def acquired(grant: Grant) -> None:
        free = torch.cuda.mem_get_info(torch.device(ctx.slot.device))[0] if ctx.slot.devices else None
        ctx.record(
            RecordKind.GRANT,
            ring=grant_ring(ring, ctx),
            seq=grant.seq,
            holder=grant.holder,
            payload=grant.payload,
            free=free,
        )
        on_acquire(grant)

    return GpuTokenRing(
        ctx.client, grant_ring(ring, ctx), ctx.slot.role, members, on_acquire=acquired, on_release=on_release
    )


def grant_ring(ring: tuple[str, ...], ctx: RoleContext) -> str:
    return f"{'+'.join(ring)}-{ctx.slot.index}"


def record_released(ctx: RoleContext) -> None:
    """Record what this process still holds on its GPU after handing the ring's token over (`meshy
    inspect` and the GPU check read it): what it allocated, and what torch keeps reserved for it."""
    if ctx.slot.devices:
        device = torch.device(ctx.slot.device)
        ctx.record(
            RecordKind.RELEASED,
            allocated=torch.cuda.memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device),
        )


def step_burst(ctx: RoleContext) -> tuple[int, float]:
    """(rows, seconds): a colocated role that leases rows to work on waits for its process's share of a
    training step's rows, for up to BURST_WAIT_S after its last lease, before it takes the devices (one
    turn per step, not one per few rows); (1, 0.0), any row at once, when the role is not colocated."""
    if ctx.slot.ring is None:
        return 1, 0.0
    algo = ctx.recipe.algorithm
    return max(1, algo.prompts_per_step * algo.group_size // ctx.slot.count), BURST_WAIT_S


@dataclass
class Turn:
    """One hold of the token (`grant` None when the role is not colocated); `payload` goes to the next
    holder with the token."""

    grant: Grant | None
    payload: Any = None


class DeviceTurns:
    """An ON_DEMAND member's turns on its ring's devices (every turn a no-op when its role is not
    colocated). Inside `turn()`, the member holds the token, its state on its devices (on_acquire); at its
    end, on_release gives the memory back and the token goes on. A BUILD turn, the member's first, skips
    on_acquire: the member builds its state on the devices then (there is nothing to onload yet), so that
    it never builds while another member computes. A turn that raises keeps the token: the process is
    failing, and the run with it. Each turn is recorded (`device_turn`: ring, grant seq, start, end, what),
    and `meshy inspect` counts turns that overlapped (members computing at once: none, ever)."""

    def __init__(self, ctx: RoleContext, on_acquire: Callable[[Grant], None], on_release: Callable[[], None]):
        self.ctx = ctx
        self._building = False
        self.ring = join_ring(ctx, lambda grant: None if self._building else on_acquire(grant), on_release)

    @contextlib.contextmanager
    def turn(self, what: str = COMPUTE) -> Iterator[Turn]:
        if self.ring is None:
            yield Turn(None)
            return
        turn = self._acquire(what)
        start = time.time()
        yield turn
        self._end(turn, start, what)

    @contextlib.asynccontextmanager
    async def turn_async(self, what: str = COMPUTE) -> AsyncIterator[Turn]:
        """turn() for a member serving on an event loop: waiting for the token and handing it on happen
        on a worker thread (on_acquire and on_release run there too)."""
        if self.ring is None:
            yield Turn(None)
            return
        turn = await asyncio.to_thread(self._acquire, what)
        start = time.time()
        yield turn
        await asyncio.to_thread(self._end, turn, start, what)

    def _acquire(self, what: str) -> Turn:
        self._building = what == BUILD
        try:
            return Turn(self.ring.acquire(timeout=TURN_TIMEOUT_S))
        finally:
            self._building = False

    def _end(self, turn: Turn, start: float, what: str) -> None:
        end = time.time()
        self.ring.release(payload=turn.payload)
        record_turn(self.ctx, self.ring, turn.grant, start, end, what)

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()


def record_turn(ctx: RoleContext, ring: GpuTokenRing, grant: Grant, start: float, end: float, what: str) -> None:
    ctx.record(RecordKind.DEVICE_TURN, ring=ring.ring, seq=grant.seq, start=start, end=end, what=what)


async def engine_turns(ctx: RoleContext, build: Callable[[], Engine]) -> tuple[Engine, DeviceTurns]:
    """The engine `build` makes for a role that scores (teacher, reference), and the role's turns:
    colocated, the engine is built in a BUILD turn, gives its device memory back at the turn's end, takes
    it only for a turn (onload), and gives it back after (release)."""
    loop = asyncio.get_running_loop()
    engine: Engine | None = None

    def run(coroutine) -> None:  # from the ring's worker thread, on the engine's event loop
        asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=120)

    def give() -> None:
        run(engine.release())
        record_released(ctx)

    turns = await asyncio.to_thread(DeviceTurns, ctx, lambda _: run(engine.onload()), give)
    async with turns.turn_async(BUILD):
        engine = build()
    return engine, turns


async def build_holding_token(ctx: RoleContext, ring: GpuTokenRing | None, build: Callable[[], T]) -> T | None:
    """What `build` makes, built by the ring's FALLBACK member (inference) while it holds the token, which
    it hands on meanwhile to every member that asks (their BUILD turns come first); recorded as its BUILD
    turn. None if the run stops first. Not colocated (ring None): built at once."""
    if ring is None:
        return build()

    def wait() -> Grant | None:
        deadline = time.monotonic() + TURN_TIMEOUT_S
        while not ring.poll(POLL_S):
            if ctx.stop.is_set():
                return None
            if time.monotonic() > deadline:
                raise DataPlaneTimeout(
                    f"ring '{ring.ring}': '{ring.member}' did not get the token back within {TURN_TIMEOUT_S}s "
                    "to build its engine"
                )
        return ring.grant

    grant = await asyncio.to_thread(wait)
    if grant is None:
        return None
    start = time.time()
    built = build()
    record_turn(ctx, ring, grant, start, time.time(), BUILD)
    return built
