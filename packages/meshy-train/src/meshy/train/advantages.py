"""Advantages for outcome rewards: GRPO group baselines and the push on groups tied below the best, DAPO overlong
shaping and dynamic sampling, critic GAE.

The overlong penalty is kept out of the critic's targets: `gae` sees only the task reward, and callers add
the penalty to the advantages afterwards (`tail_overlong_bonus`). Folded into the rewards, it would teach the
critic to predict truncation from a prefix and GAE would spread it over the whole response, instead of it
landing on the tail tokens that made the response too long.
"""

import math

import torch
from torch import Tensor

from meshy.train.shapes import check_same_2d_shape


def grpo_advantages(rewards: Tensor, scale_by_std: bool, eps: float = 1e-6) -> Tensor:
    """Per group (row of rewards [G, n]), the reward minus the group mean, optionally over (group std + eps).

    The std is the unbiased one (torch's default, Bessel-corrected, as verl uses): for small groups it is
    larger than the population std by sqrt(n / (n - 1)), so scaled advantages are slightly smaller.
    A NaN reward is a dropped row: it is left out of its group's mean and std, and its advantage is NaN;
    a group with one scored row gives it advantage 0.
    """
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards: expected a [G, n] tensor with n >= 2 samples per group, got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards: expected a floating-point tensor, got {rewards.dtype}")
    dropped = rewards.isnan()
    if not dropped.any():  # torch's own mean and std, bit for bit what runs without drops have always used
        centred = rewards - rewards.mean(dim=1, keepdim=True)
        return centred / (rewards.std(dim=1, keepdim=True) + eps) if scale_by_std else centred
    centred = rewards - rewards.nanmean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    scored = (~dropped).sum(dim=1, keepdim=True)
    variance = centred.nan_to_num().square().sum(dim=1, keepdim=True) / (scored - 1).clamp(min=1)
    return centred / (variance.sqrt() + eps)


def push_tied_groups(advantages: Tensor, rewards: Tensor, penalty: float) -> tuple[Tensor, int]:
    """Advantages [G, n] where every row of a group whose rewards are all equal and below the best reward in
    `rewards` is -penalty instead, and how many such groups there are (whatever the penalty, 0 included).

    Such a group's prompt is unsolved (another group did better) and the policy keeps giving it one answer,
    so its GRPO advantage is 0 and nothing would ever change that answer: an entropy bonus hardly moves a
    near-deterministic token. Pushing the answer down makes sampling vary again, and the group's spread
    carries signal once more. A group tied at the best (all solved, or all equally wrong when no group did
    better) keeps advantage 0. NaN rewards (dropped rows) are left out.
    """
    if rewards.shape != advantages.shape or rewards.ndim != 2:
        raise ValueError(
            f"advantages, rewards: expected [G, n] tensors of one shape, got {tuple(advantages.shape)}, "
            f"{tuple(rewards.shape)}"
        )
    if not 0 <= penalty < math.inf:
        raise ValueError(f"penalty: expected a finite value >= 0, got {penalty}")
    dropped = rewards.isnan()
    low = rewards.masked_fill(dropped, math.inf).amin(dim=1, keepdim=True)
    high = rewards.masked_fill(dropped, -math.inf).amax(dim=1, keepdim=True)
    stuck = (low == high) & (high < high.max())
    if penalty:
        advantages = advantages.masked_fill(stuck, -penalty)
    return advantages, int(stuck.sum())


def dapo_overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment per response length: 0 up to max_length - buffer, then falling linearly
    to -factor at max_length, and -factor beyond it. Returns float32."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"buffer: expected 0 < buffer <= max_length ({max_length}), got {buffer}")
    over = (max_length - buffer - lengths.to(torch.float32)) / buffer
    return over.clamp(min=-1.0, max=0.0) * factor


def drop_uniform_groups(rewards: Tensor) -> tuple[Tensor, int]:
    """Dynamic sampling: a group whose rewards are all equal has zero advantage everywhere and carries no signal.

    Returns (keep [G] bool, number of groups dropped). NaN rewards (dropped rows) are left out.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards: expected a [G, n] tensor, got shape {tuple(rewards.shape)}")
    dropped = rewards.isnan()
    keep = rewards.masked_fill(dropped, -math.inf).amax(dim=1) > rewards.masked_fill(dropped, math.inf).amin(dim=1)
    return keep, int((~keep).sum())


def sample_lambdas(lengths: Tensor, k: float) -> Tensor:
    """Per-sequence GAE lambda k ** (1 / L): the credit a reward at the end keeps after L steps of decay is k,
    whatever the response length."""
    if not 0 < k <= 1:
        raise ValueError(f"k: expected 0 < k <= 1, got {k}")
    if lengths.numel() and int(lengths.min()) < 1:
        raise ValueError(f"lengths: expected every length >= 1, got min {int(lengths.min())}")
    return k ** (1.0 / lengths.to(torch.float32))


@torch.no_grad()
def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lambdas: Tensor) -> tuple[Tensor, Tensor]:
    """GAE over each row's masked (response) tokens, with a per-sequence lambda; value after the last one is 0.

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lambda_i * A_{t+1}, where t + 1 is
    the row's next masked token: positions outside the mask are skipped, so a multi-turn row masked to
    its policy tokens is one sequence of them, the observations between turns taking no step. The
    returned `returns` are the lambda = 1 targets, sum_l gamma^l r_{t+l} (Monte-Carlo), which the critic
    trains on. Both are 0 outside the mask and carry no gradient.
    """
    check_same_2d_shape(token_rewards=token_rewards, values=values, mask=mask)
    if lambdas.shape != (values.shape[0],):
        raise ValueError(f"lambdas: expected shape ({values.shape[0]},), got {tuple(lambdas.shape)}")
    if not 0 <= gamma <= 1:
        raise ValueError(f"gamma: expected 0 <= gamma <= 1, got {gamma}")
    keep = mask.bool()
    zero = values.new_zeros(values.shape[0])
    next_value, next_advantage, next_return = zero, zero, zero
    advantages, returns = [], []
    for t in reversed(range(values.shape[1])):
        in_response = keep[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = torch.where(in_response, delta + gamma * lambdas * next_advantage, next_advantage)
        next_return = torch.where(in_response, token_rewards[:, t] + gamma * next_return, next_return)
        next_value = torch.where(in_response, values[:, t], next_value)
        advantages.append(torch.where(in_response, next_advantage, 0.0))
        returns.append(torch.where(in_response, next_return, 0.0))
    return torch.stack(advantages[::-1], dim=1), torch.stack(returns[::-1], dim=1)


def tail_overlong_bonus(advantages: Tensor, mask: Tensor, penalty: Tensor) -> Tensor:
    """Add each sequence's overlong penalty to its response tokens, decaying from the last token backwards.

    Response token t of L gets penalty * lambda_inj ** (L - 1 - t), lambda_inj = max(0, 1 - 1 / (0.1 * L)):
    the penalty reaches back about 0.1 * L tokens, and responses of 10 tokens or fewer get it on the last
    token only. Returns a new tensor; positions outside the mask are unchanged.
    """
    check_same_2d_shape(advantages=advantages, mask=mask)
    if penalty.shape != (advantages.shape[0],):
        raise ValueError(f"penalty: expected shape ({advantages.shape[0]},), got {tuple(penalty.shape)}")
    keep = mask.bool()
    lengths = keep.sum(dim=1, keepdim=True).to(advantages.dtype)
    steps_to_end = lengths - keep.cumsum(dim=1)
    decay = (1.0 - 1.0 / (0.1 * lengths)).clamp(min=0.0)
    bonus = penalty.unsqueeze(1).to(advantages.dtype) * decay**steps_to_end
    return advantages + torch.where(keep, bonus, 0.0)
