"""Colocated roles share devices through a GPU token ring: the i-th process of each role in a ring
shares ring `<roles>-<i>`. Inference is the FALLBACK member (it generates whenever nobody else needs the
devices); the others are ON_DEMAND: each burst of their compute is a turn (DeviceTurns), for which they
take the token and their state onto the devices, and after which they give both back. A member that does
not hold the token holds no device memory."""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from meshy.dataplane import FALLBACK, ON_DEMAND, GpuTokenRing, Grant
from meshy.infer.engine import Engine
from meshy.recipes.context import RoleContext

TURN_TIMEOUT_S = 600.0  # an ON_DEMAND member waiting longer for the token stops the run, naming its holder
BURST_WAIT_S = 2.0  # how long a colocated consumer waits for a training step's rows before taking fewer


def join_ring(ctx: RoleContext, on_acquire, on_release) -> GpuTokenRing | None:
    """This process's handle on its ring, or None if its role is not colocated."""
    ring = next((r for r in ctx.recipe.colocate if ctx.slot.role in r), None)
    if ring is None:
        return None
    members = [(role, FALLBACK if role == "inference" else ON_DEMAND) for role in ring]

    def acquired(grant: Grant) -> None:
        ctx.record("grant", ring=grant_ring(ring, ctx), seq=grant.seq, holder=grant.holder, payload=grant.payload)
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
            "released",
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
    end, on_release gives the memory back and the token goes on. A turn that raises keeps the token: the
    process is failing, and the run with it. Each turn is recorded (`device_turn`: ring, grant seq, start,
    end), and `meshy inspect` counts turns that overlapped (members computing at once: none, ever)."""

    def __init__(self, ctx: RoleContext, on_acquire: Callable[[Grant], None], on_release: Callable[[], None]):
        self.ctx = ctx
        self.ring = join_ring(ctx, on_acquire, on_release)

    @contextlib.contextmanager
    def turn(self) -> Iterator[Turn]:
        if self.ring is None:
            yield Turn(None)
            return
        turn = Turn(self.ring.acquire(timeout=TURN_TIMEOUT_S))
        start = time.time()
        yield turn
        self._end(turn, start)

    @contextlib.asynccontextmanager
    async def turn_async(self) -> AsyncIterator[Turn]:
        """turn() for a member serving on an event loop: waiting for the token and handing it on happen
        on a worker thread (on_acquire and on_release run there too)."""
        if self.ring is None:
            yield Turn(None)
            return
        turn = Turn(await asyncio.to_thread(self.ring.acquire, TURN_TIMEOUT_S))
        start = time.time()
        yield turn
        await asyncio.to_thread(self._end, turn, start)

    def _end(self, turn: Turn, start: float) -> None:
        end = time.time()
        self.ring.release(payload=turn.payload)
        self.ctx.record("device_turn", ring=self.ring.ring, seq=turn.grant.seq, start=start, end=end)

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()


async def engine_turns(ctx: RoleContext, engine: Engine) -> DeviceTurns:
    """The turns of a role that scores with `engine` (teacher, reference): a colocated engine gives its
    device memory back at once, takes it only for a turn (onload), and gives it back after (release)."""
    loop = asyncio.get_running_loop()

    def run(coroutine) -> None:  # from the ring's worker thread, on the engine's event loop
        asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=120)

    def give() -> None:
        run(engine.release())
        record_released(ctx)

    turns = await asyncio.to_thread(DeviceTurns, ctx, lambda _: run(engine.onload()), give)
    if turns.ring is not None:
        await engine.release()
        record_released(ctx)
    return turns
