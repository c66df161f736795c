"""The trainer on a CUDA device (the gpu tier: `pytest -m gpu`): steps, memory handed back, RNG resumed,
and logprobs that agree with the engine's in each dtype."""

import asyncio
import math

import pytest
import torch

from meshy.dataplane import HOST, free_cached
from meshy.infer.engine import SamplingParams
from meshy.infer.torch_engine import TorchEngine
from meshy.train import checkpoint, offload
from meshy.train.critic_service import CriticTrainer, ValueBatch, ValueModel
from meshy.train.logprobs import forward_logits, token_logprobs
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.publish import hf_tensors
from meshy.train.trainer import PolicyTrainer
from meshy.train.training_config import LossConfig, OptimConfig, ParallelConfig
from tests.test_device_placement import LOSSES, policy_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")
TINY = get_model("qwen3-tiny")


def on_cuda(batch):
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            setattr(batch, name, value.to(CUDA))
    return batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_policy_step_runs_on_the_gpu_with_every_loss_option(name, dtype):
    loss = LOSSES[name]
    model, _ = build_model(TINY, ParallelConfig(activation_checkpoint="full"), device=CUDA, dtype=dtype, seed=0)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-3), loss)
    for seed in (1, 2):
        metrics = trainer.step(on_cuda(policy_batch(loss, seed=seed)))
    assert trainer.steps == 2 and math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])


def test_offload_hands_the_trainer_s_memory_back_and_changes_nothing():
    arch = get_model("qwen3-0.6b")
    free_cached(CUDA)
    baseline = torch.cuda.memory_reserved()
    model, _ = build_model(arch, ParallelConfig(activation_checkpoint="full"), device=CUDA, dtype="bfloat16")
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-5), LossConfig())
    batch = on_cuda(policy_batch(LossConfig(), seed=1))
    trainer.step(batch)
    held = torch.cuda.memory_reserved() - baseline
    with torch.no_grad():
        before = forward_logits(model, batch.tokens).to(HOST)
    offload.hand_over(trainer, CUDA)
    left = torch.cuda.memory_reserved() - baseline
    assert left <= held / 100, f"reserved {held / 2**30:.2f} GiB before offload, {left / 2**30:.3f} GiB after"
    offload.move(trainer, CUDA)
    with torch.no_grad():
        assert torch.equal(forward_logits(model, batch.tokens).to(HOST), before)
    trainer.step(batch)


def test_the_critic_hands_its_memory_back_and_changes_nothing():
    """What a critic colocated in a ring does at the end of each turn (meshy.recipes.roles.colocation)."""
    arch = get_model("qwen3-0.6b")
    free_cached(CUDA)
    baseline = torch.cuda.memory_reserved()
    backbone, _ = build_model(arch, ParallelConfig(activation_checkpoint="full"), device=CUDA, dtype="bfloat16")
    critic = ValueModel(backbone, arch.hidden_size, initial_value=0.5)
    trainer = CriticTrainer(critic, OptimConfig(lr=1e-5))
    tokens = torch.randint(0, arch.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0)).to(CUDA)
    mask = torch.ones(2, 64, device=CUDA)
    batch = ValueBatch(tokens, mask, torch.rand(2, 64, device=CUDA), torch.full((2, 64), 0.5, device=CUDA))
    trainer.step(batch)
    held = torch.cuda.memory_reserved() - baseline
    with torch.no_grad():
        before = critic(tokens).to(HOST)
    offload.hand_over(trainer, CUDA)
    left = torch.cuda.memory_reserved() - baseline
    assert left <= held / 100, f"reserved {held / 2**30:.2f} GiB before handing over, {left / 2**30:.3f} GiB after"
    offload.move(trainer, CUDA)
    with torch.no_grad():
        assert torch.equal(critic(tokens).to(HOST), before)
    trainer.step(batch)


def test_a_checkpoint_restores_the_cuda_generator(tmp_path):
    model, _ = build_model(TINY, ParallelConfig(), device=CUDA, seed=0)
    trainer = PolicyTrainer(model, OptimConfig(), LossConfig())
    torch.cuda.manual_seed(123)
    saved = checkpoint.save(tmp_path, 1, trainer, {"version": 1})
    drawn = torch.rand(4, device=CUDA)
    torch.cuda.manual_seed(7)
    checkpoint.load(saved, trainer)
    assert torch.equal(torch.rand(4, device=CUDA), drawn)


@pytest.mark.parametrize(("dtype", "mean_bound", "max_bound"), [("float32", 1e-5, 1e-4), ("bfloat16", 0.05, 0.5)])
def test_trainer_and_engine_logprobs_agree_in_each_dtype(dtype, mean_bound, max_bound):
    model, _ = build_model(TINY, ParallelConfig(), device=CUDA, dtype=dtype, seed=5)
    tokens = torch.randint(0, TINY.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0)).to(CUDA)
    with torch.no_grad():
        trainer = token_logprobs(forward_logits(model, tokens), tokens)
    weights = (TINY.hf_config(dtype), dict(hf_tensors(model, TINY, getattr(torch, dtype))))

    async def engine_logprobs() -> torch.Tensor:
        engine = TorchEngine(weights, device=CUDA, dtype=dtype, max_len=64)
        try:
            return torch.tensor([(await engine.score(row.tolist())).token_logprobs for row in tokens], device=CUDA)
        finally:
            await engine.close()

    difference = (asyncio.run(engine_logprobs()) - trainer).abs()
    assert difference.mean().item() <= mean_bound and difference.max().item() <= max_bound, (
        f"{dtype}: mean {difference.mean().item():.2e}, max {difference.max().item():.2e}"
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_mixture_s_engine_routing_is_replayed_by_the_trainer_on_the_gpu(dtype):
    """TorchEngine on CUDA records each token's experts; the trainer (full checkpointing) replays them:
    its replayed experts are the engine's, and a step with them runs."""
    from meshy.train.logprobs import pack_rows
    from meshy.train.routing_replay import FREE, replay_routers, replay_routing
    from meshy.train.trainer import PolicyBatch

    moe = get_model("qwen3-tiny-moe")
    model, _ = build_model(moe, ParallelConfig(activation_checkpoint="full"), device=CUDA, dtype=dtype, seed=0)
    weights = (moe.hf_config(dtype), dict(hf_tensors(model, moe, getattr(torch, dtype))))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20]]

    async def generate():
        engine = TorchEngine(weights, device=CUDA, dtype=dtype, max_len=64)
        try:
            params = [SamplingParams(max_new_tokens=12, seed=i) for i in range(len(prompts))]
            return await asyncio.gather(*[engine.generate(f"r{i}", p, params[i]) for i, p in enumerate(prompts)])
        finally:
            await engine.close()

    generations = asyncio.run(generate())
    responses = [torch.tensor(g.output_ids, device=HOST) for g in generations]
    tokens, spans = pack_rows([torch.tensor(p, device=HOST) for p in prompts], responses)
    b, t = tokens.shape[0], tokens.shape[1] - 1
    routed = torch.full((b, t, 2, 2), FREE, dtype=torch.int64, device=HOST)
    mask = torch.zeros(b, t, device=HOST)
    for i, (generation, span) in enumerate(zip(generations, spans, strict=True)):
        assert generation.routed_experts.device == HOST and generation.routed_experts.dtype == torch.int16
        routed[i, span], mask[i, span] = generation.routed_experts.long(), 1.0
    tokens, routed, mask = tokens.to(CUDA), routed.to(CUDA), mask.to(CUDA)
    used: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: used.append(out[1])) for r in replay_routers(model)]
    with torch.no_grad(), replay_routing(model, routed):
        model(tokens[:, :-1])
    for hook in hooks:
        hook.remove()
    replayed = torch.stack(used, dim=2)
    assert torch.equal(replayed[routed >= 0], routed[routed >= 0])
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-3), LossConfig(tis="none"))
    metrics = trainer.step(PolicyBatch(tokens, mask, torch.ones(b, device=CUDA), routed_experts=routed))
    assert trainer.steps == 1 and metrics["grad_norm"] > 0
