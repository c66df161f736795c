"""Logits only where tokens are trained: the trainer's output projection skips the prompt and padding."""

import pytest
import torch

from meshy.train.config import LossConfig, OptimConfig, ParallelConfig
from meshy.train.logprobs import forward_logits, response_logits, spread, token_logprobs
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.trainer import PolicyBatch, PolicyTrainer

ARCH = get_model("qwen3-tiny")


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 12 tokens whose trained positions differ (one row trains none)."""
    tokens = torch.randint(0, ARCH.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(3, 11)
    mask[0, 4:9] = 1
    mask[1, 2:11] = 1
    return tokens, mask


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-5), ("bfloat16", 0.05)])
def test_logits_at_the_trained_positions_are_those_of_the_whole_forward(dtype, tolerance):
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", dtype=dtype, seed=0)
    tokens, mask = batch()
    positions = mask.bool()
    picked = response_logits(model, tokens, positions)
    assert picked.shape == (int(mask.sum()), ARCH.vocab_size) and picked.dtype == torch.float32
    assert (picked - forward_logits(model, tokens)[positions]).abs().max() < tolerance
    assert not model._skip_lm_head, "the model's own forward is left as it was"


def test_the_trainer_s_logprobs_are_the_whole_forward_s_at_trained_positions_and_zero_elsewhere():
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    trainer = PolicyTrainer(model, OptimConfig(), LossConfig())
    tokens, mask = batch()
    ours = trainer.logprobs(PolicyBatch(tokens, mask, torch.zeros(3)))
    expected = token_logprobs(forward_logits(model, tokens), tokens)
    assert torch.allclose(ours[mask.bool()], expected[mask.bool()], atol=1e-5)
    assert torch.equal(ours[~mask.bool()], torch.zeros(int((~mask.bool()).sum())))


def test_spread_puts_values_in_place_and_passes_their_gradient_back():
    positions = torch.tensor([[False, True, True], [True, False, False]])
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    spread_out = spread(values, positions)
    assert torch.equal(spread_out, torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]))
    (spread_out * torch.tensor([[5.0, 6.0, 7.0], [8.0, 9.0, 10.0]])).sum().backward()
    assert torch.equal(values.grad, torch.tensor([6.0, 7.0, 8.0]))
