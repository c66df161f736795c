"""Per-token RL losses and the aggregation that turns them into one scalar.

Loss functions return [B, T] tensors (and small stats dicts of Python floats over the masked tokens, nan when
the mask is empty); `aggregate` masks and reduces them. Nothing here talks to other ranks: callers pass
denominators already summed over all data-parallel ranks.
"""

import math

import torch
from torch import Tensor

from meshy.train.shapes import check_same_2d_shape

AGGREGATE_MODES = ("token_mean", "sequence_mean")
IMPORTANCE_WEIGHT_MODES = ("truncate", "mask")


def aggregate(token_loss: Tensor, mask: Tensor, mode: str, denominator: float) -> Tensor:
    """Reduce a per-token loss to this rank's share of a global mean.

    "token_mean": sum of masked token losses / denominator, the number of trained tokens on all DP ranks.
    "sequence_mean": sum over local sequences of their masked mean / denominator, the number of sequences on all
    DP ranks; a sequence with no trained tokens contributes 0. Either way the ranks' results add up to the
    global mean.
    """
    check_same_2d_shape(token_loss=token_loss, mask=mask)
    if mode not in AGGREGATE_MODES:
        raise ValueError(f"mode: expected one of {AGGREGATE_MODES}, got {mode!r}")
    if not denominator > 0:
        raise ValueError(f"denominator: expected > 0, got {denominator}")
    keep = mask.bool()
    masked_loss = torch.where(keep, token_loss, 0.0)
    if mode == "token_mean":
        return masked_loss.sum() / denominator
    sequence_means = masked_loss.sum(dim=1) / keep.sum(dim=1).clamp(min=1)
    return sequence_means.sum() / denominator


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Asymmetric PPO clipped surrogate: max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high)).

    advantages are [B, T] or [B] (one per sequence). The gradient with respect to logprobs is zero on tokens
    where the clipped branch wins.

    dual_clip c > 1 (dual-clip PPO; 0: off) also caps a negative advantage's loss at -A * c. The surrogate
    alone leaves it unbounded: a token whose ratio has run away (say to 1e4, after a step that made it far
    likelier) and whose advantage is negative would otherwise dominate the step's gradient.
    """
    check_same_2d_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    if advantages.shape == (logprobs.shape[0],):
        advantages = advantages.unsqueeze(1)
    elif advantages.shape != logprobs.shape:
        raise ValueError(
            f"advantages: expected shape {tuple(logprobs.shape)} or ({logprobs.shape[0]},), "
            f"got {tuple(advantages.shape)}"
        )
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low: expected 0 <= clip_low < 1, got {clip_low}")
    if not clip_high >= 0:
        raise ValueError(f"clip_high: expected clip_high >= 0, got {clip_high}")
    if not (dual_clip == 0 or 1 < dual_clip < math.inf):
        raise ValueError(f"dual_clip: expected 0 (off) or a finite value > 1, got {dual_clip}")
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    dual_clipped = (advantages < 0) & (ratio > (dual_clip or math.inf))
    token_loss = torch.where(dual_clipped, -advantages * dual_clip, token_loss)

    keep = mask.bool()
    with torch.no_grad():
        stats = {
            "clip_fraction": _fraction(clipped > unclipped, keep),
            "clip_low_fraction": _fraction((ratio < 1 - clip_low) & (advantages < 0), keep),
            "clip_high_fraction": _fraction((ratio > 1 + clip_high) & (advantages > 0), keep),
            "ratio_mean": _mean(ratio[keep]),
            "ratio_max": _max(ratio[keep]),
            "ratio_min": _min(ratio[keep]),
        }
        if dual_clip:
            stats["dual_clip_fraction"] = _fraction(dual_clipped, keep)
    return token_loss, stats


def importance_weights(
    train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, low: float, high: float, mode: str
) -> tuple[Tensor, dict[str, float]]:
    """Per-token weights correcting for the rollout engine sampling from a slightly different policy.

    r = exp(train - rollout) per token. "truncate": clamp(r, low, high) (truncated IS). "mask" (IcePop): r where
    low <= r <= high, else 0, dropping the token. Weights are detached and 0 outside the mask.
    """
    check_same_2d_shape(train_logprobs=train_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    if mode not in IMPORTANCE_WEIGHT_MODES:
        raise ValueError(f"mode: expected one of {IMPORTANCE_WEIGHT_MODES}, got {mode!r}")
    if not 0 < low <= 1 <= high:
        raise ValueError(f"low, high: expected 0 < low <= 1 <= high, got low={low}, high={high}")
    keep = mask.bool()
    ratio = torch.exp(train_logprobs.detach() - rollout_logprobs)
    inside = (ratio >= low) & (ratio <= high)
    weights = ratio.clamp(low, high) if mode == "truncate" else torch.where(inside, ratio, 0.0)
    stats = {
        "tis_ratio_mean": _mean(ratio[keep]),
        "tis_truncated_fraction": _fraction(~inside, keep),
        "tis_ratio_max": _max(ratio[keep]),
    }
    return torch.where(keep, weights, 0.0), stats


def kl_to_reference(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator of KL(pi || ref) per sampled token: exp(ref - logp) - (ref - logp) - 1.

    Non-negative and, for tokens sampled from pi, unbiased.
    """
    check_same_2d_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def entropy_from_log_probs(log_probs: Tensor) -> Tensor:
    """Entropy [B, T] of the distributions whose full log-softmax [B, T, V] is given (the trainer already
    has it for the token logprobs, so the softmax is not computed twice)."""
    if log_probs.ndim != 3:
        raise ValueError(f"log_probs: expected a [B, T, V] tensor, got shape {tuple(log_probs.shape)}")
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def topk_forward_kl(student_logits: Tensor, teacher_topk_ids: Tensor, teacher_topk_logprobs: Tensor) -> Tensor:
    """Forward KL(teacher || student) [B, T] over the teacher's top-k tokens, for online policy distillation.

    The teacher's top-k logprobs hold less than all of its mass, so they are renormalised into a distribution q
    over the k ids; with the raw partial mass the loss could go negative. The student's logprobs are normalised
    over the full vocabulary and only gathered at the ids, so mass the student puts elsewhere is penalised:
    loss_t = sum_j q_j * (log q_j - log p_student(id_j)), >= 0 and 0 only when the student is q on the ids.
    """
    if student_logits.ndim != 3:
        raise ValueError(f"student_logits: expected a [B, T, V] tensor, got shape {tuple(student_logits.shape)}")
    expected = (*student_logits.shape[:2], teacher_topk_ids.shape[-1])
    if teacher_topk_ids.ndim != 3 or teacher_topk_ids.shape != expected:
        raise ValueError(
            f"teacher_topk_ids: expected shape [B, T, k] with [B, T] = {tuple(student_logits.shape[:2])}, "
            f"got {tuple(teacher_topk_ids.shape)}"
        )
    if teacher_topk_ids.dtype != torch.int64:
        raise ValueError(f"teacher_topk_ids: expected an int64 tensor, got {teacher_topk_ids.dtype}")
    if teacher_topk_logprobs.shape != teacher_topk_ids.shape:
        raise ValueError(
            f"teacher_topk_logprobs: expected shape {tuple(teacher_topk_ids.shape)} (as teacher_topk_ids), "
            f"got {tuple(teacher_topk_logprobs.shape)}"
        )
    student = student_logits.float()
    student_logp = student.gather(-1, teacher_topk_ids) - student.logsumexp(dim=-1, keepdim=True)
    teacher_logq = torch.log_softmax(teacher_topk_logprobs.float(), dim=-1)
    return (teacher_logq.exp() * (teacher_logq - student_logp)).sum(dim=-1)


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float
) -> tuple[Tensor, dict[str, float]]:
    """PPO value loss 0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped = V_old + clamp(V - V_old, -clip, clip)."""
    check_same_2d_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if not clip > 0:
        raise ValueError(f"clip: expected > 0, got {clip}")
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    token_loss = 0.5 * torch.maximum(unclipped_error, clipped_error)
    keep = mask.bool()
    with torch.no_grad():
        stats = {
            "value_clip_fraction": _fraction(clipped_error > unclipped_error, keep),
            "value_error_mean": _mean((values - returns).abs()[keep]),
        }
    return token_loss, stats


def _fraction(condition: Tensor, keep: Tensor) -> float:
    return _mean(condition[keep])


def _mean(selected: Tensor) -> float:
    return selected.float().mean().item() if selected.numel() else float("nan")


def _max(selected: Tensor) -> float:
    return selected.max().item() if selected.numel() else float("nan")


def _min(selected: Tensor) -> float:
    return selected.min().item() if selected.numel() else float("nan")
