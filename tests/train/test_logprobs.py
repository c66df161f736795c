"""Logits only where tokens are trained: the trainer's output projection skips the prompt and padding."""

import pytest
import torch

from meshy.train.logprobs import forward_logits, pack_rows, response_logits, spread, token_logprobs
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.shared_prompts import MAX_PACKED_TOKENS, pack_shared_prompts
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LossConfig, OptimConfig, ParallelConfig

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


def grouped_rows(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three prompts of 7, 12 and 9 tokens, each followed by four responses of 1 to 5 tokens (GRPO groups),
    the groups' rows interleaved."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, ARCH.vocab_size, (n,), generator=g) for n in (7, 12, 9)]
    rows = [(prompts[i % 3], torch.randint(0, ARCH.vocab_size, (1 + (i * 7) % 5,), generator=g)) for i in range(12)]
    return [p for p, _ in rows], [r for _, r in rows]


def test_rows_packed_by_shared_prompt_give_each_row_s_logits_and_gradients():
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    prompts, responses = grouped_rows()
    tokens, spans = pack_rows(prompts, responses)
    mask = torch.zeros(len(prompts), tokens.shape[1] - 1)
    for i, span in enumerate(spans):
        mask[i, span] = 1
    packed = pack_shared_prompts(prompts, responses, tokens.shape[1])
    assert packed is not None and packed.tokens.shape[0] == 3, "one packed sequence per prompt"
    assert packed.tokens.numel() < 0.75 * sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    positions = mask.bool()
    grads = []
    for how in (None, packed):
        model.zero_grad()
        logits = response_logits(model, tokens, positions, how)
        logits.logsumexp(-1).mul(torch.linspace(0.5, 2, len(logits))).sum().backward()
        grads.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (rows, row_grads), (packs, pack_grads) = grads
    assert (rows - packs).abs().max() < 1e-4
    assert max((a - b).abs().max().item() for a, b in zip(row_grads, pack_grads, strict=True)) < 1e-4


def test_a_policy_step_on_packed_rows_is_the_step_on_rows():
    prompts, responses = grouped_rows(1)
    tokens, spans = pack_rows(prompts, responses)
    mask, advantages = torch.zeros(len(prompts), tokens.shape[1] - 1), torch.zeros(len(prompts), tokens.shape[1] - 1)
    for i, span in enumerate(spans):
        mask[i, span], advantages[i, span] = 1, (-1.0) ** i
    steps = []
    for packed in (None, pack_shared_prompts(prompts, responses, tokens.shape[1])):
        model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
        trainer = PolicyTrainer(model, OptimConfig(lr=1e-3), LossConfig(entropy_coef=0.01, tis="none"))
        metrics = trainer.step(PolicyBatch(tokens, mask, advantages, packed=packed))
        steps.append((metrics, [p.detach().clone() for p in model.parameters()]))
    (rows, row_params), (packs, pack_params) = steps
    assert rows["loss"] == pytest.approx(packs["loss"], abs=1e-5) and rows["stepped"] == packs["stepped"] == 1
    # Adam's first step moves each weight by about lr (1e-3) whatever its gradient's size: within 5% of it
    assert max((a - b).abs().max().item() for a, b in zip(row_params, pack_params, strict=True)) < 5e-5


def test_rows_are_not_packed_where_it_saves_little_or_the_packed_sequence_runs_long():
    g = torch.Generator().manual_seed(0)
    distinct = [torch.randint(0, 50, (8,), generator=g) for _ in range(4)]
    short = [torch.ones(2, dtype=torch.int64)] * 4
    assert pack_shared_prompts(distinct, short, 10) is None, "no prompt shared"
    assert pack_shared_prompts([distinct[0]] * 4, [torch.ones(30, dtype=torch.int64)] * 4, 38) is None
    long = torch.ones(MAX_PACKED_TOKENS, dtype=torch.int64)
    assert pack_shared_prompts([long] * 2, short[:2], MAX_PACKED_TOKENS + 2) is None
    assert pack_shared_prompts([distinct[0]] * 4, short, 10) is not None
