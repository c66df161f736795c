"""The environment role: plays multi-turn trajectories, one step per row of the data plane's `turns` table.

Two loops, and no RPC: the inference role generates turns from the turns table as it generates
responses from the rollout table in single-turn runs.
- start: leases new trajectories (task `agent` of the rollout table: problem, ground_truth), resets a
  fresh environment to each problem, renders its conversation and tools as the prompt, and writes the
  trajectory's first turn row to the turns table, then the prompt_ids to the rollout row.
- observe: leases the turns the inference role has generated (task `observe`), takes the step
  (meshy.recipes.agents.trajectory.take_turn) with a fresh environment reset to the row's problem, and
  writes the next turn's row while acking this one, in one write; or, once the trajectory has ended,
  its columns to its rollout row (from there on, rollout computes advantages and training trains on it
  as on any row).

An environment keeps no state between turns beyond its problem, the conversation and what its `state()`
gives (meshy.recipes.agents.tool_environment), all in the row; so any process takes the next step of any
trajectory, steps run concurrently (a slow tool holds up its
own trajectory only, and the engine keeps generating the others' turns), and a process that dies loses
only the steps it was taking: their leases expire and another process takes them. Every write is
idempotent by row id: a step taken twice finds its row already written and changes nothing, so no
trajectory reaches training twice.
"""

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from meshy.dataplane import HOST, Batch, RowConflictError, SchemaError
from meshy.dataplane import columns as cols
from meshy.recipes.agents.tool_environment import Environment, restore_state
from meshy.recipes.agents.trajectory import ERROR, Trajectory, open_trajectory, take_turn
from meshy.recipes.agents.turn_rows import read_turn, trajectory_columns, turn_columns
from meshy.recipes.prompts.problem import Problem
from meshy.recipes.recipe.dataflow import TURNS
from meshy.recipes.roles.context import RecordKind, RoleContext
from meshy.recipes.usercode.imports import import_object, traceback_from
from meshy.recipes.usercode.task_errors import TaskError
from meshy.recipes.usercode.task_trial import eos_mismatch

log = logging.getLogger(__name__)
STEPS_IN_FLIGHT = 1024  # turns one process steps through at once (each waits mostly on its tools)
LEASE_BATCH = 256
POLL_S = 0.5


class EnvironmentRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        recipe = ctx.recipe
        self.tokenizer = import_object(recipe.task.tokenizer, "task.tokenizer")(**recipe.task.tokenizer_options)
        if (why := eos_mismatch(recipe, self.tokenizer)) is not None:  # observations follow the engine's end of turn
            raise SchemaError(why)
        factory = import_object(recipe.task.environment, "task.environment")
        options = {"tool_timeout_s": recipe.agent.tool_timeout_s, **recipe.task.environment_options}
        self.new_environment: Callable[[], Environment] = lambda: factory(**options)
        self.new_environment()  # a factory that cannot build one fails here, before the first trajectory
        self.agent, self.limits = recipe.agent, recipe.agent.limits()
        self.lease_s = self.limits.deadline_s + 60.0  # a step never takes longer than its trajectory's deadline
        self.counts: Counter = Counter()

    def run(self) -> None:
        self.ctx.watch_for_stop()
        asyncio.run(self.ctx.until_stopped(self._serve))
        self.ctx.record(RecordKind.ENVIRONMENT, **self.counts)

    async def _serve(self, stop: asyncio.Event) -> None:
        loops = [asyncio.create_task(self._start_loop(stop)), asyncio.create_task(self._observe_loop(stop))]
        try:
            done, _ = await asyncio.wait(loops, return_when=asyncio.FIRST_EXCEPTION)
            for loop in done:
                loop.result()  # a loop that failed takes the role down, loudly
        finally:
            stop.set()
            await asyncio.gather(*loops, return_exceptions=True)

    async def _open(self, problem: Problem) -> Trajectory:
        agent = self.agent
        try:
            return await open_trajectory(
                self.new_environment(), problem, self.tokenizer, agent.template, agent.enable_thinking
            )
        except Exception as e:  # a trajectory that cannot start has no row to drop it from: the run stops
            summary = f"task.environment ({self.ctx.recipe.task.environment!r}) raised {type(e).__name__}: {e}"
            where = f"opening problem {problem.prompt!r}"
            raise TaskError("task.environment", summary, where, traceback_from(e, __file__)) from e

    # ---- new trajectories ---------------------------------------------------------------------
    async def _start_loop(self, stop: asyncio.Event) -> None:
        client, table, task = self.ctx.client, self.ctx.table, cols.AGENT_TASK
        while not stop.is_set():
            batch = await asyncio.to_thread(
                client.lease, table, task.name, list(task.reads), LEASE_BATCH, min_count=1, timeout=POLL_S
            )
            if batch is None:
                continue
            problems = [
                Problem(p, a)
                for p, a in zip(batch.columns[cols.PROBLEM], batch.columns[cols.GROUND_TRUTH], strict=True)
            ]
            opened = await asyncio.gather(*(self._open(p) for p in problems))
            rows, columns = turn_columns(list(zip(opened, batch.row_ids, problems, strict=True)), self.limits)
            await asyncio.to_thread(self._write_once, lambda r, c: client.put(TURNS, r, c), rows, columns)
            prompts = [torch.tensor(t.prompt_ids, dtype=torch.int64, device=HOST) for t in opened]
            await asyncio.to_thread(self._write_prompts, batch, prompts)
            self.counts["started"] += len(batch)

    def _write_prompts(self, batch: Batch, prompts: list[torch.Tensor]) -> None:
        """prompt_ids into the rollout rows, acking them; rows that have them already (a start taken twice)
        are only acked."""
        client, table = self.ctx.client, self.ctx.table
        try:
            client.add_columns(table, batch.row_ids, {cols.PROMPT_IDS: prompts}, ack=batch)
        except RowConflictError:
            for row, prompt in zip(batch.row_ids, prompts, strict=True):
                try:
                    client.add_columns(table, [row], {cols.PROMPT_IDS: [prompt]}, ack=batch)
                except RowConflictError:
                    self.counts["repeated_writes"] += 1
            client.ack(batch)

    def _write_once(self, write: Callable[[list[int], dict], object], rows: list[int], columns: dict) -> None:
        """write(rows, columns), all at once; if some rows were written before (a step taken twice), the
        others one by one."""
        try:
            write(rows, columns)
        except RowConflictError:
            for i, row in enumerate(rows):
                try:
                    write([row], {name: _pick(values, i) for name, values in columns.items()})
                except RowConflictError:
                    self.counts["repeated_writes"] += 1

    # ---- turns --------------------------------------------------------------------------------
    async def _observe_loop(self, stop: asyncio.Event) -> None:
        """Lease generated turns and step each as a task of its own; the steps' writes go out in groups
        (_write_steps): many steps ending together cost a few writes, not a few each."""
        client, task = self.ctx.client, cols.OBSERVE_TASK
        steps: set[asyncio.Task] = set()
        stepped: list[asyncio.Task] = []  # steps taken, not yet written
        ready, last = asyncio.Event(), asyncio.Event()  # steps to write; no step will follow
        writer = asyncio.create_task(self._write_loop(stepped, ready, last))

        def done(step: asyncio.Task) -> None:
            steps.discard(step)
            if not step.cancelled():
                stepped.append(step)
                ready.set()

        try:
            while not stop.is_set():
                if writer.done():
                    writer.result()  # a step or a write that failed takes the role down
                free = STEPS_IN_FLIGHT - len(steps) - len(stepped)
                if free <= 0:
                    await asyncio.sleep(POLL_S / 10)
                    continue
                batch = await asyncio.to_thread(
                    client.lease,
                    TURNS,
                    task.name,
                    list(task.reads),
                    min(free, LEASE_BATCH),
                    min_count=1,
                    lease_s=self.lease_s,
                    timeout=POLL_S,
                )
                for i in range(len(batch) if batch is not None else 0):
                    step = asyncio.create_task(self._step(batch, i))
                    steps.add(step)
                    step.add_done_callback(done)
        finally:
            await asyncio.gather(*steps, return_exceptions=True)
            last.set()
            ready.set()
            await writer  # what was stepped is written before the role ends

    async def _step(self, batch: Batch, i: int) -> "_Stepped":
        row, problem, trajectory, turn, error = read_turn(batch.columns, i)
        agent, env = self.agent, self.new_environment()
        try:
            await env.reset(problem)
            restore_state(env, trajectory.environment_state)
            going = await take_turn(
                trajectory, turn, env, self.tokenizer, agent.template, self.limits, agent.enable_thinking, error
            )
        except Exception as e:  # the environment failed: the run stops, or the trajectory ends here with the reason
            if self.ctx.recipe.on_task_error == "stop":
                where = f"after turn {trajectory.turns} of trajectory {row} (problem {problem.prompt!r})"
                summary = f"task.environment ({self.ctx.recipe.task.environment!r}) raised {type(e).__name__}: {e}"
                raise TaskError("task.environment", summary, where, traceback_from(e, __file__)) from e
            log.exception("environment step of trajectory %d failed", row)
            trajectory.finish_reason, trajectory.error, going = ERROR, f"environment: {type(e).__name__}: {e}", False
        return _Stepped(batch, batch.row_ids[i], row, problem, trajectory, going)

    async def _write_loop(self, stepped: list[asyncio.Task], ready: asyncio.Event, last: asyncio.Event) -> None:
        """Write what was stepped since the last write, until the last step is written."""
        while not (last.is_set() and not stepped):
            await ready.wait()
            ready.clear()
            group = [step.result() for step in stepped]
            del stepped[: len(group)]
            if group:
                await asyncio.to_thread(self._write_steps, group)

    def _write_steps(self, group: list["_Stepped"]) -> None:
        """Each lease's steps that go on as its next turn rows, acking these in the same write; the
        trajectories that ended into their rollout rows (all in one write), then their turn rows acked."""
        client = self.ctx.client
        by_batch: dict[int, list[_Stepped]] = {}
        for s in group:
            by_batch.setdefault(id(s.batch), []).append(s)
        for steps in by_batch.values():
            going = [s for s in steps if s.going]
            if going:
                rows, columns = turn_columns([(s.trajectory, s.row, s.problem) for s in going], self.limits)
                self._put_next(rows, columns, going[0].batch, [s.turn_row for s in going])
        ended = [s for s in group if not s.going]
        for s in ended:  # recorded before the write: a row kept on disk after a kill has its record
            self._finished(s.row, s.trajectory)
        if ended:
            columns = trajectory_columns([s.trajectory for s in ended])
            self._write_once(lambda r, c: client.add_columns(self.ctx.table, r, c), [s.row for s in ended], columns)
        for steps in by_batch.values():
            if rows := [s.turn_row for s in steps if not s.going]:
                client.ack(steps[0].batch, rows)
        self.counts["turns"] += len(group)

    def _put_next(self, rows: list[int], columns: dict, batch: Batch, turn_rows: list[int]) -> None:
        """The next turns' rows, acking the turns they follow; one by one if some were written before (a
        step taken twice: then its turn is only acked)."""
        try:
            self.ctx.client.put(TURNS, rows, columns, ack=batch, ack_rows=turn_rows)
        except RowConflictError:
            for i, (row, turn_row) in enumerate(zip(rows, turn_rows, strict=True)):
                try:
                    one = {name: _pick(values, i) for name, values in columns.items()}
                    self.ctx.client.put(TURNS, [row], one, ack=batch, ack_rows=[turn_row])
                except RowConflictError:
                    self.counts["repeated_writes"] += 1
                    self.ctx.client.ack(batch, [turn_row])

    def _finished(self, row: int, trajectory: Trajectory) -> None:
        self.counts[f"finished_{trajectory.finish_reason}"] += 1
        self.ctx.record(
            RecordKind.TRAJECTORY,
            row=row,
            finish_reason=trajectory.finish_reason,
            turns=trajectory.turns,
            tokens=len(trajectory.response_ids),
            reward=trajectory.reward,
            tool_calls=dict(trajectory.tool_calls),
            tool_errors=dict(trajectory.tool_errors),
            tool_seconds=trajectory.tool_seconds,
            error=trajectory.error,
        )


@dataclass
class _Stepped:
    """A step taken, waiting for its write: the lease and turn row it came from, its trajectory's rollout
    row and problem, the trajectory with the step, and whether it goes on."""

    batch: Batch
    turn_row: int
    row: int
    problem: Problem
    trajectory: Trajectory
    going: bool


def _pick(values: Sequence | torch.Tensor, i: int) -> Sequence | torch.Tensor:
    """Row i of one column's values, as the values of a one-row write."""
    return values[i : i + 1]
