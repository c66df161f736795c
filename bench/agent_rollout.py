"""Multi-turn rollout: trajectories per second when every turn waits on a slow tool, against the same
trajectories with an instant one, in one run on this machine, played in this process and through the
data plane as a run plays them.

    uv run python bench/agent_rollout.py [--trajectories 256] [--sequential 16] [--turns 3] [--latency 0.1]

One small recipe is the policy and the task: qwen3-tiny with random weights on the CPU, Qwen3's chat
template, the byte tokenizer, and an environment whose tool answers every turn after `--latency` seconds
and is never done, so every trajectory ends at `--turns` turns. It is played two ways:
  in-process   one TorchEngine in this process; meshy.recipes.agents.trajectory.run_trajectory loops
               each trajectory
  data plane   this process starts a data plane and writes the problem rows to the rollout table; an
               InferenceService (a TorchEngine of its own) generates the turns table's rows in a
               spawned process, and the EnvironmentRole steps the trajectories from the turns table in
               a thread of this process, with a client and an asyncio loop of its own (the bench's
               driver beside it only waits on the data plane; a third process would add seconds of
               imports to the smoke test on a busy machine). The time runs from the problem rows'
               write to the last trajectory's reward column (which a `bench` task of the rollout table
               waits for)
Each turn is seeded by its turns-table row, as the inference service seeds it, and ends at a stop token
(1 id in 16), so every mode of both paths generates the same tokens, and the modes differ only in how
the tool's latency is spent:
  instant tool   the environment answers at once, every trajectory in flight together
  slow tool      `--latency` per turn, every trajectory in flight together (the engine generates the
                 other trajectories' turns while one waits)
  sequential     `--latency` per turn, one trajectory at a time (the first `--sequential` trajectories)
Target: the slow tool at >= 0.8x the instant one's trajectories per second (as in an RL batch, many
trajectories are in flight: the target needs enough of them to keep the engine busy while some wait).
The in-process rows are the engine and the asyncio loop alone; the data plane's rows beside them add
what a run pays on top: the tables' round trips, and the processes the roles run in.
"""

import argparse
import asyncio
import contextlib
import gc
import multiprocessing
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from meshy.dataplane import DataPlaneClient, DataPlaneServer, Endpoints, TableSpec, new_secret
from meshy.dataplane import columns as cols
from meshy.infer.engine import Generation
from meshy.infer.inference_service import InferenceService, InferenceServiceConfig
from meshy.infer.torch_engine import TorchEngine
from meshy.recipes.agents.tool_environment import Step
from meshy.recipes.agents.trajectory import MAX_TURNS, run_trajectory
from meshy.recipes.agents.turn_rows import turn_row_id
from meshy.recipes.prompts.chat_templates import Message
from meshy.recipes.prompts.problem import Problem
from meshy.recipes.recipe import (
    AgentSpec,
    ModelSpec,
    Recipe,
    RoleSpec,
    RolesSpec,
    SamplingSpec,
    TaskSpec,
    check_recipe,
)
from meshy.recipes.recipe.dataflow import TURNS
from meshy.recipes.recipe.topology import Slot
from meshy.recipes.roles.context import RoleContext, announce_stop
from meshy.recipes.roles.environment import EnvironmentRole
from meshy.recipes.tasks.byte_tokenizer import ByteTokenizer
from meshy.train.parallel import build_model
from meshy.train.publish import hf_tensors
from meshy.train.training_config import ParallelConfig

TOKENIZER = ByteTokenizer()
STOP_EVERY = 16  # a turn ends at any id that is a multiple of it
ROLLOUT = cols.rollout_table().name
BENCH_TASK = cols.Task("bench", reads=(cols.REWARD, cols.FINISH_REASON, cols.POLICY_MASK), retires=True)
INFERENCE_SLOT = Slot(rank=1, role="inference", index=0, count=1, devices=(), ring=None)
ENVIRONMENT_SLOT = Slot(rank=2, role="environment", index=0, count=1, devices=(), ring=None)
STALL_S = 120.0  # the data plane's modes give up when no trajectory finishes for this long


class FixedLatencyTool:
    """Answers every turn with a tool result after `latency` seconds and is never done: a trajectory ends
    at the recipe's turn limit. Keeps no state: the environment role takes each step with a fresh one."""

    def __init__(self, latency: float):
        self.latency = latency

    def tool_schemas(self) -> list[dict]:
        return []

    async def reset(self, problem: Problem) -> list[Message]:
        return [Message("user", f"{problem.prompt}: use the tool.")]

    async def step(self, action: str) -> Step:
        await asyncio.sleep(self.latency)
        return Step(["42"], 0.0, False)


def fixed_latency_tool(tool_timeout_s: float, latency: float) -> FixedLatencyTool:
    """The recipe's environment factory (the tool answers well within the recipe's tool timeout)."""
    return FixedLatencyTool(latency)


@dataclass(frozen=True)
class Mode:
    name: str
    latency: float
    trajectories: int
    concurrent: bool  # every trajectory in flight together, or one at a time


def modes(args: argparse.Namespace) -> list[Mode]:
    slow = f"{args.latency * 1000:.0f} ms tool"
    return [
        Mode("instant tool", 0.0, args.trajectories, True),
        Mode(slow, args.latency, args.trajectories, True),
        Mode(f"{slow}, sequential", args.latency, args.sequential, False),
    ]


def bench_recipe(args: argparse.Namespace, latency: float) -> Recipe:
    """The recipe both paths play; the data plane's environment role is built from it. The model ends its
    turns at the byte tokenizer's <|im_end|>, as the environment role requires."""
    context = args.max_tokens + 256  # the prompt and a trajectory's tokens: past the tiny model's 512 positions
    recipe = Recipe(
        name="agent-rollout-bench",
        model=ModelSpec(
            args.model, overrides={"eos_token_id": TOKENIZER.eos_token_id, "max_position_embeddings": context}
        ),
        task=TaskSpec(
            tokenizer="meshy.recipes.tasks.byte_tokenizer:ByteTokenizer",
            environment=f"{__name__}:{fixed_latency_tool.__name__}",
            environment_options={"latency": latency},
        ),
        agent=AgentSpec(max_turns=args.turns, max_tokens=args.max_tokens, deadline_s=600.0),
        sampling=SamplingSpec(max_new_tokens=args.max_tokens, context_length=context, max_in_flight=args.trajectories),
        roles=RolesSpec(environment=RoleSpec()),
    )
    check_recipe(recipe)  # what load_recipe checks of a whole run (--turns, --max-tokens against the context)
    return recipe


def problem(row: int) -> Problem:
    return Problem(f"Problem {row}", "42")


def new_engine(recipe: Recipe) -> TorchEngine:
    """The recipe's model with random weights (seed 0: the same in every process)."""
    arch = recipe.model.arch()
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=0)
    source = (arch.hf_config("float32"), dict(hf_tensors(model, arch, torch.float32)))
    return TorchEngine(source, max_running=recipe.sampling.max_in_flight, max_len=recipe.sampling.context_length)


def inference_config(recipe: Recipe) -> InferenceServiceConfig:
    """The turns table's generation: the recipe's sampling, each row seeded by its id (seed 0), every
    turn ending at 1 id in STOP_EVERY."""
    sampling = recipe.sampling
    stops = tuple(range(0, recipe.model.arch().vocab_size, STOP_EVERY))
    return InferenceServiceConfig(
        table=TURNS,
        sampling=replace(sampling.params(seed=0), stop_token_ids=stops),
        max_in_flight=sampling.max_in_flight,
        context_length=sampling.context_length,
    )


def summary(played: Sequence[tuple[str, int]], seconds: float) -> dict:
    """played: (finish reason, policy tokens) of each trajectory."""
    return {
        "seconds": seconds,
        "finished": sum(reason == MAX_TURNS for reason, _ in played),
        "tokens": sum(tokens for _, tokens in played),
        "per_s": len(played) / seconds,
    }


# ---- in-process ---------------------------------------------------------------------------------
async def play(engine: TorchEngine, recipe: Recipe, row: int, latency: float) -> tuple[str, int]:
    """One trajectory, each turn sampled as the inference service samples turn row `turn_row_id(row, turn)`."""
    sampling, agent, turns = inference_config(recipe).row_sampling, recipe.agent, 0

    async def generate(input_ids: list[int], max_new_tokens: int) -> Generation:
        nonlocal turns
        params = sampling(turn_row_id(row, turns), max_new_tokens)
        turns += 1
        return await engine.generate(f"{latency}/{row}/{turns}", input_ids, params)

    env, limits = FixedLatencyTool(latency), agent.limits()
    trajectory = await run_trajectory(
        env, problem(row), generate, TOKENIZER, agent.template, limits, agent.enable_thinking
    )
    return trajectory.finish_reason, sum(trajectory.policy_mask)


async def in_process_mode(engine: TorchEngine, recipe: Recipe, mode: Mode) -> dict:
    start = time.perf_counter()
    rows = range(mode.trajectories)
    if mode.concurrent:
        played = await asyncio.gather(*(play(engine, recipe, row, mode.latency) for row in rows))
    else:
        played = [await play(engine, recipe, row, mode.latency) for row in rows]
    return summary(played, time.perf_counter() - start)


async def in_process(args: argparse.Namespace) -> list[tuple[Mode, dict]]:
    recipe = bench_recipe(args, 0.0)
    engine = new_engine(recipe)
    try:
        await in_process_mode(engine, recipe, modes(args)[0])  # warm-up
        return [(mode, await in_process_mode(engine, recipe, mode)) for mode in modes(args)]
    finally:
        await engine.close()


# ---- through the data plane ---------------------------------------------------------------------
def bench_tables() -> list[TableSpec]:
    """The rollout table (its rows retire once the bench has seen their reward) and the turns table."""
    tasks = (cols.PROBLEMS_TASK, cols.AGENT_TASK, BENCH_TASK)
    return [cols.rollout_table(tasks=tasks, multi_turn=True), cols.turns_table()]


@dataclass(frozen=True)
class LiveDataPlane:
    endpoints: Endpoints
    secret: bytes
    client: DataPlaneClient  # the bench's own: it writes the problems and reads the rewards
    run_dir: Path  # where the roles' record files go


def serve_inference(endpoints: Connection, secret: bytes, recipe: Recipe, run_dir: str) -> None:
    """The inference process: an InferenceService generating the turns table's rows until the run stream
    says stop. It starts while the data plane starts (each imports for seconds), and waits for its
    endpoints."""
    with DataPlaneClient(endpoints.recv(), secret, name="inference0") as client:
        ctx = RoleContext(recipe, INFERENCE_SLOT, Path(run_dir), client)
        ctx.watch_for_stop()
        asyncio.run(generate_turns(ctx))
    gc.freeze()  # no final collection over torch's heap at exit (as a run's ranks): the bench waits for it


async def generate_turns(ctx: RoleContext) -> None:
    engine = new_engine(ctx.recipe)
    try:
        await ctx.until_stopped(InferenceService(ctx.client, engine, inference_config(ctx.recipe)).run)
    finally:
        await engine.close()


class StoppedByTheBench(RoleContext):
    """A role context whose `stop` the bench sets once a mode's trajectories are played. Nothing watches
    the run stream: its readers replay it from the start, so each mode's role would see the stops of the
    modes before it."""

    def watch_for_stop(self) -> None:
        pass


@contextlib.contextmanager
def environment_role(plane: LiveDataPlane, recipe: Recipe) -> Iterator[None]:
    """An EnvironmentRole of `recipe` (a mode's tool latency is its recipe's) stepping trajectories until
    the block ends, in a thread of this process with a client and an asyncio loop of its own."""
    with DataPlaneClient(plane.endpoints, plane.secret, name="environment0") as client:
        ctx = StoppedByTheBench(recipe, ENVIRONMENT_SLOT, plane.run_dir, client)
        role = threading.Thread(target=EnvironmentRole(ctx).run, name="environment-role")
        role.start()
        try:
            yield
        finally:
            ctx.stop.set()
            role.join()  # every step it took is written and acked


def play_rows(client: DataPlaneClient, rows: Sequence[int]) -> list[tuple[str, int]]:
    """Write the problem rows, then wait for their trajectories' reward columns: (finish reason, policy
    tokens) of each."""
    problems = [problem(row) for row in rows]
    columns = {cols.PROBLEM: [p.prompt for p in problems], cols.GROUND_TRUTH: [p.answer for p in problems]}
    client.put(ROLLOUT, list(rows), columns)
    played: list[tuple[str, int]] = []
    while len(played) < len(rows):
        batch = client.lease(
            ROLLOUT, BENCH_TASK.name, list(BENCH_TASK.reads), len(rows) - len(played), min_count=1, timeout=STALL_S
        )
        if batch is None:
            raise RuntimeError(f"no trajectory finished in {STALL_S:.0f} s")
        client.ack(batch)
        finished = zip(batch.columns[cols.FINISH_REASON], batch.columns[cols.POLICY_MASK], strict=True)
        played += [(reason, int(mask.sum())) for reason, mask in finished]
    return played


def check_drained(client: DataPlaneClient) -> None:
    """Every mode plays the same row ids (their ids seed their turns): the last mode's must all be gone."""
    left = {table: client.table_stats(table)["rows"] for table in (ROLLOUT, TURNS)}
    if any(left.values()):
        raise RuntimeError(f"rows left by the last mode: {left}")


def dataplane_mode(plane: LiveDataPlane, args: argparse.Namespace, mode: Mode) -> dict:
    with environment_role(plane, bench_recipe(args, mode.latency)):
        start = time.perf_counter()
        if mode.concurrent:
            played = play_rows(plane.client, range(mode.trajectories))
        else:
            played = [one for row in range(mode.trajectories) for one in play_rows(plane.client, [row])]
        seconds = time.perf_counter() - start
    check_drained(plane.client)
    return summary(played, seconds)


def through_the_data_plane(args: argparse.Namespace) -> list[tuple[Mode, dict]]:
    secret, recipe, spawn = new_secret(), bench_recipe(args, 0.0), multiprocessing.get_context("spawn")
    endpoints, their_endpoints = spawn.Pipe()
    with tempfile.TemporaryDirectory() as run_dir:
        inference = spawn.Process(target=serve_inference, args=(their_endpoints, secret, recipe, run_dir), daemon=True)
        inference.start()
        with (
            DataPlaneServer.start(secret) as server,
            DataPlaneClient(server.endpoints, secret, name="bench") as client,
        ):
            for spec in bench_tables():
                client.create_table(spec)
            endpoints.send(server.endpoints)
            plane = LiveDataPlane(server.endpoints, secret, client, Path(run_dir))
            try:
                dataplane_mode(plane, args, modes(args)[0])  # warm-up (and the inference process's start)
                return [(mode, dataplane_mode(plane, args, mode)) for mode in modes(args)]
            finally:
                announce_stop(client, "bench done")
                inference.join(timeout=60)


def print_table(args: argparse.Namespace, paths: dict[str, list[tuple[Mode, dict]]]) -> None:
    print(
        f"\nagent rollout, {args.model}, trajectories of {args.turns} turns, on the CPU; in-process: one engine "
        "in this process; data plane: the inference service in a process of its own, the environment role in this one"
    )
    print("| path | tool | trajectories done | policy tokens | seconds | trajectories/s | vs instant |")
    print("|---|---|---|---|---|---|---|")
    for path, rows in paths.items():
        instant = rows[0][1]["per_s"]
        for mode, row in rows:
            print(
                f"| {path} | {mode.name} | {row['finished']} | {row['tokens']} | {row['seconds']:.2f} | "
                f"{row['per_s']:.2f} | {row['per_s'] / instant:.2f}x |"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--sequential", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.1)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--model", default="qwen3-tiny")
    args = parser.parse_args(argv)
    paths = {"in-process": asyncio.run(in_process(args)), "data plane": through_the_data_plane(args)}
    print_table(args, paths)


if __name__ == "__main__":
    main()
