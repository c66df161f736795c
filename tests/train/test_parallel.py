import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshy.dataplane import SchemaError
from meshy.train.critic_service import CriticTrainer, ValueBatch, ValueModel
from meshy.train.logprobs import forward_logits, token_logprobs
from meshy.train.models import get_model
from meshy.train.parallel import build_model, load_weights
from meshy.train.publish import hf_tensors
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LossConfig, OptimConfig, ParallelConfig

REPO = Path(__file__).resolve().parents[2]


def two_ranks(script: str, *args: object) -> None:
    """Runs a torchrun body of this directory on two CPU ranks; it must succeed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(Path(__file__).with_name(script)), *map(str, args)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize(
    ("model_name", "ep", "replicas"),
    [
        ("qwen3-tiny", 1, 1),
        ("minicpm5-tiny", 1, 1),
        ("qwen3-tiny-moe", 1, 1),
        ("qwen3-tiny-moe", 2, 1),
        ("qwen3-tiny", 1, 2),
    ],
)
def test_two_rank_fsdp_gradients_and_step_metrics_equal_single_process_ones(model_name, ep, replicas, tmp_path):
    """ep = 2: the experts split over the two ranks (what the Qwen3-30B-A3B recipes run), tokens sent to
    their experts' rank and back. replicas = 2: each rank holds the whole model (dp_replicate, HSDP with
    one shard), gradients summed over the replicas. torchtitan computes routed experts in bfloat16
    whatever the model's dtype: with ep = 1 each rank's expert gradients are rounded to bfloat16 before
    the two are summed, so they differ from one process's by that rounding (with ep = 2 each expert sees
    all its tokens on one rank, as in one process)."""
    arch = get_model(model_name)
    reference, _ = build_model(arch, ParallelConfig(), device="cpu", seed=3)
    torch.manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (4, 9))
    mask = (torch.rand(4, 8) < 0.7).float()
    advantages, ref_logprobs = torch.randn(4), -torch.rand(4, 8) - 1.0
    weights = dict(hf_tensors(reference, arch, torch.float32))
    inputs = dict(weights=weights, tokens=tokens, mask=mask, advantages=advantages, ref_logprobs=ref_logprobs)
    torch.save(inputs, tmp_path / "inputs.pt")

    logprobs = token_logprobs(forward_logits(reference, tokens), tokens)
    (-(logprobs * mask).sum() / mask.sum()).backward()

    two_ranks("fsdp_grads.py", model_name, tmp_path / "inputs.pt", tmp_path / "grads.pt", ep, replicas)
    saved = torch.load(tmp_path / "grads.pt")
    fsdp = saved["grads"]
    assert set(fsdp) == {name for name, _ in reference.named_parameters()}
    for name, param in reference.named_parameters():
        error = ((fsdp[name] - param.grad).norm() / param.grad.norm()).item()
        bound = 2**-8 if "routed_experts" in name and ep == 1 else 1e-6  # bfloat16's rounding, or none
        assert error <= bound, f"{name}: relative error {error:.2e}"

    one, _ = build_model(arch, ParallelConfig(), device="cpu", seed=3)
    trainer = PolicyTrainer(one, OptimConfig(), LossConfig(tis="none", kl_coef=0.1))
    metrics = trainer.step(PolicyBatch(tokens, mask, advantages, ref_logprobs=ref_logprobs))
    for key in ("loss", "pg_loss", "kl", "entropy"):  # global means, not rank 0's share of them
        assert saved["metrics"][key] == pytest.approx(metrics[key], rel=1e-5), key


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_two_rank_critic_steps_as_one_process_does(replicas, tmp_path):
    """What the JustRL II recipe runs (its critic on 2 GPUs): the value head is sharded beside the backbone,
    so gradient clipping sees one kind of tensor (a plain value head crashed the first critic step), and
    the step's metrics are the whole batch's, not rank 0's share. A checkpoint of it restores the critic:
    the next step is the same from the restored one. replicas = 2: the whole critic on each rank (HSDP)."""
    arch = get_model("qwen3-tiny")
    torch.manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (4, 9))
    mask = (torch.rand(4, 8) < 0.7).float()
    returns, old_values = torch.rand(4, 8), 0.5 + 0.3 * torch.randn(4, 8)
    backbone, _ = build_model(arch, ParallelConfig(), device="cpu", seed=3)
    weights = dict(hf_tensors(backbone, arch, torch.float32))
    inputs = dict(weights=weights, tokens=tokens, mask=mask, returns=returns, old_values=old_values)
    torch.save(inputs, tmp_path / "inputs.pt")
    two_ranks("critic_ranks.py", tmp_path / "inputs.pt", tmp_path / "out.pt", tmp_path / "checkpoints", replicas)
    saved = torch.load(tmp_path / "out.pt")

    trainer = CriticTrainer(ValueModel(backbone, arch.hidden_size, 0.5), OptimConfig(lr=1e-2), value_clip=0.2)
    metrics = trainer.step(ValueBatch(tokens, mask, returns, old_values))
    assert 0 < metrics["value_clip_fraction"] < 1, "both branches of the clipped loss are taken"
    for key in ("value_loss", "grad_norm", "value_clip_fraction", "value_error_mean"):
        assert saved["metrics"][key] == pytest.approx(metrics[key], rel=1e-5), key
    one = dict(trainer.model.named_parameters())
    assert set(saved["params"]) == set(one)
    for name, param in one.items():
        assert torch.allclose(saved["params"][name], param.detach(), rtol=1e-5, atol=1e-6), name
    assert not torch.equal(one["value_head.weight"], torch.zeros_like(one["value_head.weight"])), "the head learned"
    continued, restored = saved["second"]
    assert continued == restored and continued["value_loss"] < metrics["value_loss"]


@pytest.mark.parametrize("model_name", ["qwen3-tiny", "qwen3-tiny-moe"])
def test_weights_load_into_a_model_and_reproduce_it(model_name):
    """What `model.init` does with an HF checkpoint (a mixture's included: the Qwen3-30B-A3B recipes)."""
    arch = get_model(model_name)
    source, _ = build_model(arch, ParallelConfig(), device="cpu", seed=1)
    target, _ = build_model(arch, ParallelConfig(), device="cpu", seed=2)
    tokens = torch.randint(0, arch.vocab_size, (2, 7))
    assert not torch.equal(forward_logits(source, tokens), forward_logits(target, tokens))
    load_weights(target, arch, dict(hf_tensors(source, arch, torch.float32)))
    assert torch.equal(forward_logits(source, tokens), forward_logits(target, tokens))


def test_one_process_computes_in_the_model_dtype_with_the_recipe_s_checkpointing():
    """A single training process applies the same dtype and activation checkpointing a sharded one
    does (it is not sharded, so the dtype comes from autocast): float32 weights, bfloat16 compute."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    arch = get_model("qwen3-tiny")
    full, _ = build_model(arch, ParallelConfig(), device="cpu", seed=4)
    half, _ = build_model(arch, ParallelConfig(activation_checkpoint="full"), device="cpu", dtype="bfloat16", seed=4)
    assert all(p.dtype == torch.float32 for p in half.parameters()), "the optimizer keeps float32 weights"
    assert all(isinstance(block, CheckpointWrapper) for block in half.layers.values())
    assert not any(isinstance(block, CheckpointWrapper) for block in full.layers.values())
    tokens = torch.randint(0, arch.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert full(tokens).dtype == torch.float32 and half(tokens).dtype == torch.bfloat16
    difference = (forward_logits(half, tokens) - forward_logits(full, tokens)).abs().max().item()
    assert 0 < difference < 0.05, "the same weights, computed in bfloat16"
    token_logprobs(forward_logits(half, tokens), tokens).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in half.parameters())


def test_an_unknown_dtype_is_refused_naming_the_field():
    with pytest.raises(SchemaError, match="build_model dtype: expected one of \\['float32', 'bfloat16'\\]"):
        build_model(get_model("qwen3-tiny"), ParallelConfig(), device="cpu", dtype="float16")


@pytest.mark.slow
def test_one_process_compiles_its_blocks_as_a_sharded_one_does():
    arch = get_model("qwen3-tiny")
    compiled, _ = build_model(
        arch, ParallelConfig(compile=True, activation_checkpoint="selective"), device="cpu", dtype="bfloat16", seed=2
    )
    eager, _ = build_model(arch, ParallelConfig(), device="cpu", dtype="bfloat16", seed=2)
    tokens = torch.randint(0, arch.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    ours = token_logprobs(forward_logits(compiled, tokens), tokens)
    ours.sum().backward()
    assert (ours - token_logprobs(forward_logits(eager, tokens), tokens)).abs().max().item() < 0.02
    assert all(p.grad is not None for p in compiled.parameters())
