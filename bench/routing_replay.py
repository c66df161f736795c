"""Routing replay on a mixture of experts: how much of the importance ratio's spread is routing.

    uv run python bench/routing_replay.py [--experts 32 --top-k 4] [--prompts 64] [--response 32] [--json out.json]
    python bench/routing_replay.py --device cuda --dtype bfloat16 --model qwen3-30b-a3b --layers 4 --sharpen 1

TorchEngine samples responses from a tiny MoE (weights published by the trainer, every matrix scaled by
`--sharpen`: freshly initialised routers are nearly uniform, so nearly every token would be a tie) and
records each token's experts. The trainer (torchtitan's MoE: its own router, grouped-GEMM experts in
bfloat16) then computes the same tokens' logprobs, routing freely or replaying the engine's routing, in
two conditions:
- same weights: the trainer holds the weights the engine sampled with; only numerics differ.
- policy drift: one optimizer step (`--lr`, PPO loss on random advantages) between sampling and
  training, as in an off-policy (pacing > 1) run or a version's later minibatches.
For each, over every response token: how often a layer's free routing differs from the engine's (the
set of experts), and the spread of the importance ratio exp(trainer logprob - engine logprob): standard
deviation and largest |log ratio|, and the share of tokens whose ratio is outside [0.8, 1.25].
"""

import argparse
import asyncio
import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from meshy.dataplane import HOST
from meshy.infer.engine import SamplingParams
from meshy.infer.torch_engine import TorchEngine
from meshy.train.logprobs import forward_logits, pack_rows, token_logprobs
from meshy.train.models import DecoderArch, get_model
from meshy.train.parallel import build_model
from meshy.train.publish import DTYPES, hf_tensors
from meshy.train.routing_replay import FREE, replay_routers, replay_routing
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LossConfig, OptimConfig, ParallelConfig

RATIO_LOW, RATIO_HIGH = 0.8, 1.25
HEADER = (
    "| model | condition | replay | tokens | routing differs | std log ratio | max abs log ratio "
    "| ratio outside [0.8, 1.25] |"
)


@dataclass
class Samples:
    """The engine's responses, packed as the trainer packs rows."""

    tokens: torch.Tensor  # [B, T] prompt + response, right-padded
    mask: torch.Tensor  # [B, T-1] response positions
    engine_logprobs: torch.Tensor  # [B, T-1]
    routed_experts: torch.Tensor  # [B, T-1, layers, top_k], FREE outside the responses


@dataclass
class Spread:
    model: str  # name, layers x experts / top-k, dtype
    condition: str
    replay: bool
    tokens: int
    routing_differs: float  # share of (token, layer) whose free trainer routing is another set of experts
    std: float
    max_abs: float
    outside: float

    def row(self) -> str:
        differs = "-" if self.replay else f"{100 * self.routing_differs:.2f}%"
        return (
            f"| {self.model} | {self.condition} | {'yes' if self.replay else 'no'} | {self.tokens} | {differs} "
            f"| {self.std:.2e} | {self.max_abs:.2e} | {100 * self.outside:.2f}% |"
        )


def architecture(args: argparse.Namespace) -> DecoderArch:
    arch = get_model(args.model)
    return dataclasses.replace(
        arch,
        num_experts=args.experts or arch.num_experts,
        num_experts_per_tok=args.top_k or arch.num_experts_per_tok,
        num_hidden_layers=args.layers or arch.num_hidden_layers,
    )


def sharpened_model(args: argparse.Namespace) -> torch.nn.Module:
    model, _ = build_model(architecture(args), ParallelConfig(), device=args.device, dtype=args.dtype, seed=args.seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.mul_(args.sharpen)
    return model


async def generate(args: argparse.Namespace, model: torch.nn.Module) -> Samples:
    arch = architecture(args)
    source = (arch.hf_config(args.dtype), dict(hf_tensors(model, arch, DTYPES[args.dtype])))
    engine = TorchEngine(
        source, max_running=args.prompts, max_len=args.prompt + args.response, device=args.device, dtype=args.dtype
    )
    g = torch.Generator(HOST).manual_seed(args.seed)
    prompts = [torch.randint(3, arch.vocab_size, (args.prompt,), generator=g, device=HOST) for _ in range(args.prompts)]
    params = [SamplingParams(max_new_tokens=args.response, seed=args.seed * 1000 + i) for i in range(args.prompts)]
    try:
        generations = await asyncio.gather(
            *[engine.generate(f"r{i}", p.tolist(), params[i]) for i, p in enumerate(prompts)]
        )
    finally:
        await engine.close()
    responses = [torch.tensor(g.output_ids, dtype=torch.int64, device=HOST) for g in generations]
    tokens, spans = pack_rows(prompts, responses)
    b, t = tokens.shape[0], tokens.shape[1] - 1
    mask = torch.zeros(b, t, device=HOST)
    logprobs = torch.zeros(b, t, device=HOST)
    routed = torch.full((b, t, arch.num_hidden_layers, arch.num_experts_per_tok), FREE, dtype=torch.int64, device=HOST)
    for i, (generation, span) in enumerate(zip(generations, spans, strict=True)):
        mask[i, span] = 1.0
        logprobs[i, span] = torch.tensor(generation.logprobs, device=HOST)
        routed[i, span] = generation.routed_experts.long()
    to = torch.device(args.device)
    return Samples(tokens.to(to), mask.to(to), logprobs.to(to), routed.to(to))


def describe(args: argparse.Namespace) -> str:
    arch = architecture(args)
    shape = f"{arch.num_hidden_layers}L {arch.num_experts}E top{arch.num_experts_per_tok}"
    return f"{args.model} {shape} {args.dtype}"


@torch.no_grad()
def measure(model: torch.nn.Module, samples: Samples, name: str, condition: str, replay: bool) -> Spread:
    chosen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen.append(out[1])) for r in replay_routers(model)]
    try:
        with replay_routing(model, samples.routed_experts if replay else None):
            logits = forward_logits(model, samples.tokens)
    finally:
        for hook in hooks:
            hook.remove()
    response = samples.mask.bool()
    log_ratio = (token_logprobs(logits, samples.tokens) - samples.engine_logprobs)[response].double()
    trainer_sets = torch.stack(chosen, dim=2).sort(dim=-1).values[response]
    engine_sets = samples.routed_experts.sort(dim=-1).values[response]
    differs = (trainer_sets != engine_sets).any(dim=-1).double().mean().item()
    ratio = log_ratio.exp()
    return Spread(
        model=name,
        condition=condition,
        replay=replay,
        tokens=int(response.sum()),
        routing_differs=differs,
        std=log_ratio.std().item(),
        max_abs=log_ratio.abs().max().item(),
        outside=((ratio < RATIO_LOW) | (ratio > RATIO_HIGH)).double().mean().item(),
    )


def drift(model: torch.nn.Module, samples: Samples, args: argparse.Namespace) -> None:
    """One PPO step on the sampled tokens with random advantages (the same step whichever routing the
    later measurement uses)."""
    trainer = PolicyTrainer(model, OptimConfig(lr=args.lr), LossConfig(tis="none"))
    g = torch.Generator(HOST).manual_seed(args.seed + 1)
    advantages = torch.randn(len(samples.tokens), generator=g, device=HOST).to(samples.tokens.device)
    trainer.step(PolicyBatch(samples.tokens, samples.mask, advantages))


def run(args: argparse.Namespace) -> list[Spread]:
    torch.manual_seed(args.seed)
    model = sharpened_model(args)
    samples = asyncio.run(generate(args, model))
    name = describe(args)
    spreads = [measure(model, samples, name, "same weights", replay) for replay in (False, True)]
    drift(model, samples, args)
    spreads += [measure(model, samples, name, f"after one step (lr {args.lr:g})", replay) for replay in (False, True)]
    return spreads


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-tiny-moe")
    parser.add_argument("--experts", type=int, default=0, help="experts per layer (0: the model's)")
    parser.add_argument("--top-k", type=int, default=0, help="experts per token (0: the model's)")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--response", type=int, default=32, help="response tokens")
    parser.add_argument("--sharpen", type=float, default=4.0, help="scale of every weight matrix")
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate of the drift step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="engine and trainer compute dtype"
    )
    parser.add_argument("--json", type=Path, help="also write the table's rows here")
    return parser.parse_args(argv)


def main() -> None:
    args = arguments()
    spreads = run(args)
    arch = architecture(args)
    print(
        f"{args.model} ({arch.num_hidden_layers} layers, {arch.num_experts} experts, top {arch.num_experts_per_tok}), "
        f"{args.prompts} prompts x {args.response} response tokens, weights x{args.sharpen:g}, {args.dtype}, "
        f"seed {args.seed}, {args.device}"
    )
    print(HEADER)
    print("|---|---|---|---|---|---|---|---|")
    for spread in spreads:
        print(spread.row())
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(s) for s in spreads], indent=1))


if __name__ == "__main__":
    main()
