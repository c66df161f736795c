"""Multi-turn rollout: trajectories per second when every turn waits on a slow tool, against the same
trajectories with an instant one, in one run on this machine.

    uv run python bench/agent_rollout.py [--trajectories 256] [--sequential 16] [--turns 3] [--latency 0.1]

One TorchEngine (random weights, on the CPU) is the policy of `--trajectories` trajectories played with
meshy.recipes.agents.trajectory.run_trajectory (Qwen3's chat template, the byte tokenizer). The
environment answers each turn after `--latency` seconds, and the trajectory is done after `--turns`
turns. A turn ends at a stop token (1 id in 16; sampled with a seed per trajectory and turn), so the
modes generate the same tokens and differ only in how the tool's latency is spent:
  instant tool   the environment answers at once, every trajectory in flight together
  slow tool      `--latency` per turn, every trajectory in flight together (the engine generates the
                 other trajectories' turns while one waits)
  sequential     `--latency` per turn, one trajectory at a time (the first `--sequential` trajectories)
Target: the slow tool at >= 0.8x the instant one's trajectories per second (as in an RL batch, many
trajectories are in flight: the target needs enough of them to keep the engine busy while some wait).
"""

import argparse
import asyncio
import time

import torch

from meshy.infer.engine import SamplingParams
from meshy.infer.torch_engine import TorchEngine
from meshy.recipes.agents.environment import Step
from meshy.recipes.agents.trajectory import DONE, AgentLimits, Trajectory, run_trajectory
from meshy.recipes.tasks.byte_tokenizer import ByteTokenizer
from meshy.recipes.tasks.chat_templates import Message
from meshy.train.models import get_model
from meshy.train.parallel import ParallelConfig, build_model
from meshy.train.publish import hf_tensors

TOKENIZER = ByteTokenizer()


class SlowTool:
    """Answers every turn with a tool result after `latency` seconds; done after `turns` turns."""

    def __init__(self, latency: float, turns: int):
        self.latency, self.turns, self.taken = latency, turns, 0

    def tool_schemas(self) -> list[dict]:
        return []

    async def reset(self, problem: int) -> list[Message]:
        return [Message("user", f"Problem {problem}: use the tool.")]

    async def step(self, action: str) -> Step:
        self.taken += 1
        await asyncio.sleep(self.latency)
        return Step(["42"], 0.0, self.taken >= self.turns)


async def play(engine: TorchEngine, index: int, latency: float, args: argparse.Namespace) -> Trajectory:
    stops = tuple(range(0, engine.vocab_size, 16))
    turns = 0

    async def generate(input_ids: list[int], max_new_tokens: int):
        nonlocal turns
        turns += 1
        params = SamplingParams(max_new_tokens, seed=1000 * index + turns, stop_token_ids=stops)
        return await engine.generate(f"t{index}-{turns}-{latency}", input_ids, params)

    limits = AgentLimits(max_turns=args.turns, max_tokens=args.max_tokens, deadline_s=600)
    return await run_trajectory(SlowTool(latency, args.turns), index, generate, TOKENIZER, "qwen3", limits)


async def mode(engine: TorchEngine, latency: float, concurrent: bool, args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    if concurrent:
        done = await asyncio.gather(*(play(engine, i, latency, args) for i in range(args.trajectories)))
    else:
        done = [await play(engine, i, latency, args) for i in range(args.sequential)]
    seconds = time.perf_counter() - start
    finished = sum(t.finish_reason == DONE for t in done)
    tokens = sum(sum(t.policy_mask) for t in done)
    return {"seconds": seconds, "finished": finished, "tokens": tokens, "per_s": len(done) / seconds}


async def bench(args: argparse.Namespace) -> list[tuple[str, dict]]:
    arch = get_model(args.model)
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=0)
    source = (arch.hf_config("float32"), dict(hf_tensors(model, arch, torch.float32)))
    engine = TorchEngine(source, max_running=args.trajectories, max_len=args.max_tokens + 256)
    try:
        await mode(engine, 0.0, True, args)  # warm-up
        return [
            ("instant tool", await mode(engine, 0.0, True, args)),
            (f"{args.latency * 1000:.0f} ms tool", await mode(engine, args.latency, True, args)),
            (f"{args.latency * 1000:.0f} ms tool, sequential", await mode(engine, args.latency, False, args)),
        ]
    finally:
        await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--sequential", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.1)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--model", default="qwen3-tiny")
    args = parser.parse_args()
    rows = asyncio.run(bench(args))
    print(f"\nagent rollout, {args.model}, trajectories of {args.turns} turns, one engine on the CPU")
    print("| tool | trajectories done | policy tokens | seconds | trajectories/s | vs instant |")
    print("|---|---|---|---|---|---|")
    instant = rows[0][1]["per_s"]
    for name, row in rows:
        print(
            f"| {name} | {row['finished']} | {row['tokens']} | {row['seconds']:.2f} | {row['per_s']:.2f} | "
            f"{row['per_s'] / instant:.2f}x |"
        )


if __name__ == "__main__":
    main()
