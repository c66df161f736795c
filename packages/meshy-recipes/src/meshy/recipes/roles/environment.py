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
gives (meshy.recipes.agents.environment), all in the row; so any process takes the next step of any
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

import torch

from meshy.dataplane import HOST, Batch, RowConflictError, SchemaError
from meshy.dataplane import rollout as cols
from meshy.recipes.agents.environment import Environment, restore_state
from meshy.recipes.agents.trajectory import ERROR, Trajectory, open_trajectory, take_turn
from meshy.recipes.agents.turn_rows import read_turn, trajectory_columns, turn_columns
from meshy.recipes.context import RoleContext
from meshy.recipes.dataflow import TURNS
from meshy.recipes.imports import import_object
from meshy.recipes.tasks.arithmetic import Problem

log = logging.getLogger(__name__)
STEPS_IN_FLIGHT = 1024  # turns one process steps through at once (each waits mostly on its tools)
LEASE_BATCH = 256
POLL_S = 0.5


class EnvironmentRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        recipe = ctx.recipe
        self.tokenizer = import_object(recipe.task.tokenizer, "task.tokenizer")(**recipe.task.tokenizer_options)
        eos, arch = self.tokenizer.eos_token_id, recipe.model.arch()
        if eos != arch.eos_token_id:  # the engine ends a turn at the model's eos; observations follow its <|im_end|>
            raise SchemaError(
                f"model.overrides.eos_token_id: the engine ends a turn at the model's eos_token_id "
                f"({arch.eos_token_id}), and a multi-turn task's turns end at its tokenizer's end of turn "
                f"({eos}); expected them equal"
            )
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
        self.ctx.record("environment", **self.counts)

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
        return await open_trajectory(
            self.new_environment(), problem, self.tokenizer, agent.template, agent.enable_thinking
        )

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
            opened = [await self._open(p) for p in problems]
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
        client, task = self.ctx.client, cols.OBSERVE_TASK
        steps: set[asyncio.Task] = set()
        try:
            while not stop.is_set():
                for step in [s for s in steps if s.done()]:
                    steps.discard(step)
                    step.result()  # a step that could not write takes the role down
                free = STEPS_IN_FLIGHT - len(steps)
                if free <= 0:
                    await asyncio.wait(steps, return_when=asyncio.FIRST_COMPLETED)
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
                if batch is not None:
                    steps.update(asyncio.create_task(self._step(batch, i)) for i in range(len(batch)))
        finally:
            await asyncio.gather(*steps, return_exceptions=True)

    async def _step(self, batch: Batch, i: int) -> None:
        row, problem, trajectory, turn, error = read_turn(batch.columns, i)
        agent, env = self.agent, self.new_environment()
        try:
            await env.reset(problem)
            restore_state(env, trajectory.environment_state)
            going = await take_turn(
                trajectory, turn, env, self.tokenizer, agent.template, self.limits, agent.enable_thinking, error
            )
        except Exception as e:  # the environment failed: the trajectory ends here, kept with the reason
            log.exception("environment step of trajectory %d failed", row)
            trajectory.finish_reason, trajectory.error, going = ERROR, f"environment: {type(e).__name__}: {e}", False
        client = self.ctx.client
        turn_row = batch.row_ids[i]
        if going:
            rows, columns = turn_columns([(trajectory, row, problem)], self.limits)
            await asyncio.to_thread(self._put_next, rows, columns, batch, turn_row)
            self.counts["turns"] += 1
            return
        columns = trajectory_columns(trajectory)
        await asyncio.to_thread(self._write_once, lambda r, c: client.add_columns(self.ctx.table, r, c), [row], columns)
        await asyncio.to_thread(client.ack, batch, [turn_row])
        self.counts["turns"] += 1
        self.counts[f"finished_{trajectory.finish_reason}"] += 1
        self.ctx.record(
            "trajectory",
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

    def _put_next(self, rows: list[int], columns: dict, batch: Batch, turn_row: int) -> None:
        try:
            self.ctx.client.put(TURNS, rows, columns, ack=batch, ack_rows=[turn_row])
        except RowConflictError:  # the next turn was written by an earlier take of this step
            self.counts["repeated_writes"] += 1
            self.ctx.client.ack(batch, [turn_row])


def _pick(values: Sequence | torch.Tensor, i: int) -> Sequence | torch.Tensor:
    """Row i of one column's values, as the values of a one-row write."""
    return values[i : i + 1]
