import math

import pytest
import torch

from meshy.train.advantages import (
    dapo_overlong_penalty,
    drop_uniform_groups,
    gae,
    grpo_advantages,
    push_tied_groups,
    sample_lambdas,
    tail_overlong_bonus,
)
from meshy.train.losses import (
    aggregate,
    clipped_value_loss,
    entropy_from_log_probs,
    importance_weights,
    kl_to_reference,
    ppo_clip_loss,
    topk_forward_kl,
)

NAN = float("nan")


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=1e-6)


def logprobs_for(ratios, old: float = -1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, old_logprobs) whose exp-difference is `ratios`."""
    logprobs = torch.tensor([[old + math.log(r) for r in row] for row in ratios])
    return logprobs, torch.full_like(logprobs, old)


# advantages


def test_grpo_advantages_centre_per_group_and_scale_by_unbiased_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    # row 0: mean 0.5, unbiased var = 4 * 0.25 / 3; row 1: mean 2, unbiased var = (1 + 1) / 3
    std0, std1 = math.sqrt(1 / 3), math.sqrt(2 / 3)
    close(grpo_advantages(rewards, scale_by_std=False), [[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]])
    a0, a1 = 0.5 / (std0 + 1e-6), 1.0 / (std1 + 1e-6)
    close(grpo_advantages(rewards, scale_by_std=True), [[a0, -a0, -a0, a0], [a1, -a1, 0.0, 0.0]])


def test_dropped_rows_nan_rewards_are_left_out_of_their_groups_advantages():
    nan = float("nan")
    rewards = torch.tensor([[1.0, nan, 0.0, 0.0], [nan, nan, nan, 1.0], [nan] * 4])
    scored = torch.tensor([[1.0, 0.0, 0.0]])
    expected = grpo_advantages(scored, scale_by_std=True)[0].tolist()
    advantages = grpo_advantages(rewards, scale_by_std=True)
    close(advantages[0, [0, 2, 3]], expected)  # the group's mean and std over its three scored rows
    assert advantages[0, 1].isnan() and advantages[1, :3].isnan().all() and advantages[2].isnan().all()
    assert advantages[1, 3] == 0.0  # one scored row: nothing to compare it with
    close(grpo_advantages(rewards, scale_by_std=False)[0, [0, 2, 3]], [2 / 3, -1 / 3, -1 / 3])
    tied = torch.tensor([[0.0, nan, 0.0], [1.0, 0.0, nan], [nan] * 3])
    assert push_tied_groups(torch.zeros(3, 3), tied, penalty=0.1)[1] == 1  # only the group tied at 0
    keep, dropped = drop_uniform_groups(tied)
    assert keep.tolist() == [False, True, False] and dropped == 2


def test_push_tied_groups_pushes_down_only_groups_tied_below_the_best():
    rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.4, 0.4, 0.4], [1.0, 1.0, 1.0], [0.4, 0.4, 0.3]])
    advantages = grpo_advantages(rewards, scale_by_std=True)
    pushed, stuck = push_tied_groups(advantages, rewards, penalty=0.1)
    assert stuck == 2  # the groups tied at 0 and at 0.4; the one tied at the best (1) is solved
    close(pushed[[0, 2]], [[-0.1] * 3] * 2)
    close(pushed[[1, 3, 4]], advantages[[1, 3, 4]].tolist())
    unpushed, stuck = push_tied_groups(advantages, rewards, penalty=0.0)
    assert stuck == 2 and bool((unpushed == advantages).all())
    alike = torch.tensor([[0.5, 0.5], [0.5, 0.5]])  # every group tied at the batch's best: none below it
    assert push_tied_groups(torch.zeros(2, 2), alike, penalty=0.1)[1] == 0
    with pytest.raises(ValueError, match="penalty: expected a finite value >= 0, got -0.1"):
        push_tied_groups(advantages, rewards, penalty=-0.1)
    with pytest.raises(ValueError, match=r"advantages, rewards: expected \[G, n\] tensors of one shape"):
        push_tied_groups(advantages[:2], rewards, penalty=0.1)


def test_dapo_overlong_penalty_is_zero_then_linear_then_flat():
    lengths = torch.tensor([5, 6, 7, 10, 11])
    out = dapo_overlong_penalty(lengths, max_length=10, buffer=4, factor=0.5)
    # free up to 10 - 4 = 6 tokens, then (6 - L) / 4 * 0.5, then -0.5 past 10
    assert out.dtype == torch.float32
    close(out, [0.0, 0.0, (6 - 7) / 4 * 0.5, (6 - 10) / 4 * 0.5, -0.5])


def test_drop_uniform_groups_marks_and_counts_groups_with_equal_rewards():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5], [2.0, 2.0, 3.0]])
    keep, dropped = drop_uniform_groups(rewards)
    assert keep.tolist() == [False, True, False, True]
    assert dropped == 2


def test_sample_lambdas_are_k_to_the_one_over_length():
    close(sample_lambdas(torch.tensor([1, 4, 10]), k=0.5), [0.5, 0.5**0.25, 0.5**0.1])


def test_gae_with_gamma_one_and_per_sample_lambda_matches_unrolled_recursion():
    # row 0: prompt token, 3 response tokens, padding; row 1: 2 response tokens, padding. nan where ignored.
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    rewards = torch.tensor([[NAN, 0.0, 0.0, 1.0, NAN], [0.0, -1.0, NAN, NAN, NAN]])
    values = torch.tensor([[NAN, 0.5, 0.25, 0.75, NAN], [0.5, -0.5, NAN, NAN, NAN]])
    lambdas = torch.tensor([0.5, 0.9])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lambdas=lambdas)

    # row 0, lambda 0.5, value after the last response token is 0
    a3 = 1.0 + 0.0 - 0.75
    a2 = (0.0 + 0.75 - 0.25) + 0.5 * a3
    a1 = (0.0 + 0.25 - 0.5) + 0.5 * a2
    # row 1, lambda 0.9
    b1 = -1.0 + 0.0 - (-0.5)
    b0 = (0.0 + (-0.5) - 0.5) + 0.9 * b1
    assert (a3, a2, a1, b1, b0) == (0.25, 0.625, 0.0625, -0.5, -1.45)
    close(advantages, [[0.0, a1, a2, a3, 0.0], [b0, b1, 0.0, 0.0, 0.0]])
    close(returns, [[0.0, 1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, 0.0, 0.0, 0.0]])


def test_gae_over_a_multi_turn_row_skips_the_observation_tokens_between_policy_turns():
    """Policy tokens 0, 1, 4, 5 with observation tokens 2, 3 between them (nan: never read): the same
    advantages and returns as the policy tokens alone, one after the other, and 0 at the observations."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]], device="cpu")
    rewards = torch.tensor([[0.0, 0.0, NAN, NAN, 0.0, 1.0, NAN]], device="cpu")
    values = torch.tensor([[0.1, 0.2, NAN, NAN, 0.4, 0.6, NAN]], device="cpu")
    lambdas = torch.tensor([0.8], device="cpu")
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lambdas=lambdas)
    policy = [0, 1, 4, 5]
    alone, alone_returns = gae(
        rewards[:, policy], values[:, policy], torch.ones(1, 4, device="cpu"), gamma=0.9, lambdas=lambdas
    )
    close(advantages[:, policy], alone.tolist())
    close(returns[:, policy], alone_returns.tolist())
    close(advantages[:, [2, 3, 6]], [[0.0, 0.0, 0.0]])
    close(returns[:, [2, 3, 6]], [[0.0, 0.0, 0.0]])
    assert alone[0, 1] == pytest.approx((0.0 + 0.9 * 0.4 - 0.2) + 0.9 * 0.8 * alone[0, 2].item())


def test_gae_returns_are_discounted_monte_carlo_and_lambda_one_advantages_are_returns_minus_values():
    rewards = torch.tensor([[1.0, 0.0, 2.0]])
    values = torch.tensor([[0.2, 0.4, 0.1]], requires_grad=True)
    advantages, returns = gae(rewards, values, torch.ones(1, 3), gamma=0.5, lambdas=torch.tensor([1.0]))
    r2 = 2.0
    r1 = 0.0 + 0.5 * r2
    r0 = 1.0 + 0.5 * r1
    close(returns, [[r0, r1, r2]])
    close(advantages, [[r0 - 0.2, r1 - 0.4, r2 - 0.1]])
    assert not advantages.requires_grad and not returns.requires_grad


def test_tail_overlong_bonus_decays_back_from_the_last_response_token():
    # row 0: 20 response tokens after a prompt token; row 1: 3 tokens; row 2: none
    mask = torch.zeros(3, 22)
    mask[0, 1:21] = 1
    mask[1, 0:3] = 1
    advantages = torch.full((3, 22), 0.1)
    out = tail_overlong_bonus(advantages, mask, penalty=torch.tensor([-1.0, -0.5, -2.0]))

    lam20 = max(0.0, 1 - 1 / (0.1 * 20))  # 0.5
    lam3 = max(0.0, 1 - 1 / (0.1 * 3))  # 0: the whole penalty lands on the last token
    assert (lam20, lam3) == (0.5, 0.0)
    row0 = [0.1] + [0.1 - 1.0 * lam20 ** (19 - t) for t in range(20)] + [0.1]
    row1 = [0.1, 0.1, 0.1 - 0.5] + [0.1] * 19
    close(out, [row0, row1, [0.1] * 22])
    assert torch.equal(advantages, torch.full((3, 22), 0.1))


# losses


def test_aggregate_token_mean_and_sequence_mean_with_an_empty_sequence():
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [NAN, NAN, NAN], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [0, 1, 0]])
    close(aggregate(token_loss, mask, "token_mean", denominator=10), (1 + 2 + 3 + 8) / 10)
    # sequence means 2, 0 (no trained tokens), 8 over 6 sequences on all ranks
    close(aggregate(token_loss, mask, "sequence_mean", denominator=6), (2 + 0 + 8) / 6)


def test_aggregate_token_mean_of_each_rank_adds_up_to_the_global_mean():
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    global_tokens = 4
    per_rank = [aggregate(token_loss[i : i + 1], mask[i : i + 1], "token_mean", global_tokens) for i in range(2)]
    close(per_rank[0] + per_rank[1], (1 + 2 + 3 + 8) / 4)


def test_ppo_clip_loss_takes_the_clipped_branch_on_both_sides():
    # column 3 is masked out (ratios 10 and 0.01 must not reach the stats)
    logprobs, old = logprobs_for([[1.1, 1.5, 0.5, 10.0], [0.5, 1.5, 0.9, 0.01]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    loss, stats = ppo_clip_loss(logprobs, old, torch.tensor([1.0, -2.0]), mask, clip_low=0.2, clip_high=0.28)
    expected = [
        # A = +1: inside; above 1.28 -> clipped at -1.28; below 0.8 -> unclipped (-0.5 > -0.8); ratio 10 -> clipped
        [-1.1, -1.28, -0.5, -1.28],
        # A = -2: below 0.8 -> clipped at 2 * 0.8; above 1.28 -> unclipped (3.0 > 2.56); inside; 0.01 -> clipped
        [2 * 0.8, 2 * 1.5, 2 * 0.9, 2 * 0.8],
    ]
    close(loss, expected)
    assert stats == pytest.approx(
        {
            "clip_fraction": 2 / 6,
            "clip_low_fraction": 1 / 6,
            "clip_high_fraction": 1 / 6,
            "ratio_mean": (1.1 + 1.5 + 0.5 + 0.5 + 1.5 + 0.9) / 6,
            "ratio_max": 1.5,
            "ratio_min": 0.5,
        },
        rel=1e-5,
    )


def test_ppo_clip_loss_gives_zero_gradient_on_clipped_tokens():
    logprobs, old = logprobs_for([[1.1, 1.5, 0.5], [0.5, 1.5, 0.9]])
    logprobs.requires_grad_(True)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    loss, _ = ppo_clip_loss(logprobs, old, advantages, torch.ones(2, 3), clip_low=0.2, clip_high=0.28)
    loss.sum().backward()
    # d(-A * ratio)/d logprob = -A * ratio where unclipped, 0 where the clipped branch won
    close(logprobs.grad, [[-1.1, 0.0, -0.5], [0.0, 2 * 1.5, 2 * 0.9]])


def test_dual_clip_caps_a_negative_advantage_and_stops_its_gradient():
    # ratios 1e4 and 5 have run away; 2 is below the cap c = 3; the masked 50 must not reach the stats
    logprobs, old = logprobs_for([[1e4, 5.0, 2.0, 50.0], [1e4, 5.0, 2.0, 50.0]])
    logprobs.requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    advantages = torch.tensor([-2.0, 1.0])
    loss, stats = ppo_clip_loss(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # A = -2: capped at 2 * 3 above the cap, -A * ratio below it; A = +1: the ordinary clip at 1.28
    close(loss, [[6.0, 6.0, 4.0, 6.0], [-1.28, -1.28, -1.28, -1.28]])
    loss.sum().backward()
    close(logprobs.grad, [[0.0, 0.0, 4.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert stats["dual_clip_fraction"] == pytest.approx(2 / 6)
    assert stats["ratio_max"] == pytest.approx(1e4, rel=1e-4)

    # Off (the default), the same negative-advantage tokens keep their unbounded loss and gradient.
    unbounded, stats = ppo_clip_loss(logprobs.detach(), old, advantages, mask, clip_low=0.2, clip_high=0.28)
    assert unbounded[0, 0].item() == pytest.approx(2e4, rel=1e-4)
    assert "dual_clip_fraction" not in stats


def test_importance_weights_truncate_and_icepop_mask():
    train, rollout = logprobs_for([[0.25, 1.0, 3.0], [1.5, 0.4, 1.9]])
    train.requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])

    weights, stats = importance_weights(train, rollout, mask, low=0.5, high=2.0, mode="truncate")
    close(weights, [[0.5, 1.0, 2.0], [1.5, 0.0, 1.9]])
    assert not weights.requires_grad
    assert stats == pytest.approx(
        {"tis_ratio_mean": (0.25 + 1.0 + 3.0 + 1.5 + 1.9) / 5, "tis_truncated_fraction": 2 / 5, "tis_ratio_max": 3.0},
        rel=1e-5,
    )

    weights, _ = importance_weights(train, rollout, mask, low=0.5, high=2.0, mode="mask")
    close(weights, [[0.0, 1.0, 0.0], [1.5, 0.0, 1.9]])


def test_icepop_keeps_ratios_on_the_bounds():
    logprobs = torch.tensor([[-1.0, -2.0]])
    weights, stats = importance_weights(logprobs, logprobs.clone(), torch.ones(1, 2), low=1.0, high=1.0, mode="mask")
    close(weights, [[1.0, 1.0]])
    assert stats["tis_truncated_fraction"] == 0.0


def test_kl_to_reference_is_the_k3_estimator():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0]])
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 0.0, 1.0)]
    assert min(k3) == 0.0
    close(kl_to_reference(logprobs, ref), [k3])


def test_entropy_from_log_probs():
    log_probs = torch.log(torch.tensor([[[0.5, 0.5], [0.25, 0.75]]]))
    expected = [[math.log(2.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]]
    close(entropy_from_log_probs(log_probs), expected)
    close(entropy_from_log_probs(torch.log_softmax(torch.zeros(1, 1, 4), -1)), [[math.log(4.0)]])


def test_topk_forward_kl_renormalises_the_teacher_and_not_the_student():
    # student probabilities (1, 2, 1, 3) / 7; teacher top-2: id 3 with 0.6, id 1 with 0.2 -> q = (0.75, 0.25)
    student_logits = torch.tensor([[[0.0, math.log(2.0), 0.0, math.log(3.0)]]], requires_grad=True)
    ids = torch.tensor([[[3, 1]]])
    teacher = torch.tensor([[[math.log(0.6), math.log(0.2)]]])
    loss = topk_forward_kl(student_logits, ids, teacher)
    expected = 0.75 * (math.log(0.75) - math.log(3 / 7)) + 0.25 * (math.log(0.25) - math.log(2 / 7))
    close(loss, [[expected]])

    loss.sum().backward()
    # d/dlogits of -sum_j q_j log p(id_j) = p - q (scattered onto the ids)
    close(student_logits.grad, [[[1 / 7, 2 / 7 - 0.25, 1 / 7, 3 / 7 - 0.75]]])


def test_topk_forward_kl_upcasts_student_logits_to_float32():
    # bf16 holds 256 and 258 exactly, but not their logsumexp 258.127 (it would round to 258)
    student_logits = torch.tensor([[[256.0, 258.0]]], dtype=torch.bfloat16)
    ids = torch.tensor([[[0, 1]]])
    teacher = torch.tensor([[[math.log(0.5), math.log(0.5)]]])
    log_z = 258.0 + math.log(1 + math.exp(-2.0))
    expected = 0.5 * (math.log(0.5) - (256.0 - log_z)) + 0.5 * (math.log(0.5) - (258.0 - log_z))
    # float32 spacing near 258 is 3e-5; bf16 arithmetic would be off by 0.13
    torch.testing.assert_close(
        topk_forward_kl(student_logits, ids, teacher), torch.tensor([[expected]]), atol=1e-4, rtol=0
    )


def test_clipped_value_loss_and_its_gradient():
    old = torch.zeros(1, 5)
    values = torch.tensor([[0.5, 0.1, 0.5, 0.5, 5.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 0.0, 0.6, 0.0, -5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = clipped_value_loss(values, old, returns, mask, clip=0.2)
    expected = [
        0.5 * max((0.5 - 1.0) ** 2, (0.2 - 1.0) ** 2),  # clipped value 0.2 is further from the return
        0.5 * 0.1**2,  # inside the clip: both branches equal
        0.5 * max((0.5 - 0.6) ** 2, (0.2 - 0.6) ** 2),  # clipped
        0.5 * max((0.5 - 0.0) ** 2, (0.2 - 0.0) ** 2),  # unclipped
        0.5 * max(10.0**2, (0.2 + 5.0) ** 2),  # masked out
    ]
    close(loss, [expected])
    assert stats == pytest.approx({"value_clip_fraction": 2 / 4, "value_error_mean": (0.5 + 0.1 + 0.1 + 0.5) / 4})

    (loss * mask).sum().backward()
    # d/dV of 0.5 (V - R)^2 = V - R on unclipped tokens; 0 where the saturated clipped branch won
    close(values.grad, [[0.0, 0.1, 0.0, 0.5, 0.0]])


def test_stats_are_nan_when_nothing_is_trained():
    logprobs = torch.zeros(1, 2)
    _, stats = ppo_clip_loss(logprobs, logprobs, torch.ones(1), torch.zeros(1, 2), clip_low=0.2, clip_high=0.2)
    assert all(math.isnan(v) for v in stats.values())


# bad inputs

X = torch.zeros(2, 3)
ONES = torch.ones(2, 3)
LOGITS = torch.zeros(2, 3, 8)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: grpo_advantages(torch.zeros(4, 1), True), "rewards: expected a [G, n] tensor with n >= 2"),
        (lambda: grpo_advantages(torch.zeros(4), True), "rewards: expected a [G, n] tensor"),
        (lambda: grpo_advantages(torch.zeros(2, 2, dtype=torch.int64), True), "rewards: expected a floating-point"),
        (lambda: dapo_overlong_penalty(torch.tensor([1]), 10, 0), "buffer: expected 0 < buffer <= max_length (10)"),
        (lambda: dapo_overlong_penalty(torch.tensor([1]), 10, 11), "buffer: expected 0 < buffer <= max_length"),
        (lambda: drop_uniform_groups(torch.zeros(4)), "rewards: expected a [G, n] tensor, got shape (4,)"),
        (lambda: sample_lambdas(torch.tensor([3]), k=0.0), "k: expected 0 < k <= 1, got 0.0"),
        (lambda: sample_lambdas(torch.tensor([3]), k=1.5), "k: expected 0 < k <= 1"),
        (lambda: sample_lambdas(torch.tensor([3, 0]), k=0.5), "lengths: expected every length >= 1, got min 0"),
        (
            lambda: gae(X, torch.zeros(2, 4), ONES, 1.0, torch.ones(2)),
            "token_rewards, values, mask: expected [B, T] tensors of one shape, "
            "got token_rewards=(2, 3), values=(2, 4), mask=(2, 3)",
        ),
        (lambda: gae(X, X, ONES, 1.0, torch.ones(3)), "lambdas: expected shape (2,), got (3,)"),
        (lambda: gae(X, X, ONES, 1.5, torch.ones(2)), "gamma: expected 0 <= gamma <= 1, got 1.5"),
        (lambda: tail_overlong_bonus(X, ONES, torch.ones(2, 1)), "penalty: expected shape (2,), got (2, 1)"),
        (lambda: tail_overlong_bonus(X, torch.ones(3), torch.ones(2)), "advantages, mask: expected [B, T]"),
        (lambda: aggregate(X, ONES, "mean", 1.0), "mode: expected one of ('token_mean', 'sequence_mean'), got 'mean'"),
        (lambda: aggregate(X, ONES, "token_mean", 0), "denominator: expected > 0, got 0"),
        (lambda: aggregate(X, torch.ones(3, 2), "token_mean", 1), "token_loss, mask: expected [B, T]"),
        (lambda: ppo_clip_loss(X, X, torch.zeros(2), ONES, 1.0, 0.2), "clip_low: expected 0 <= clip_low < 1, got 1.0"),
        (lambda: ppo_clip_loss(X, X, torch.zeros(2), ONES, -0.1, 0.2), "clip_low: expected 0 <= clip_low < 1"),
        (lambda: ppo_clip_loss(X, X, torch.zeros(2), ONES, 0.2, -0.1), "clip_high: expected clip_high >= 0, got -0.1"),
        (lambda: ppo_clip_loss(X, X, torch.zeros(3), ONES, 0.2, 0.2), "advantages: expected shape (2, 3) or (2,)"),
        (lambda: ppo_clip_loss(X, X, ONES, ONES, 0.2, 0.2, 1.0), "dual_clip: expected 0 (off) or a finite value > 1"),
        (lambda: ppo_clip_loss(X, X, ONES, ONES, 0.2, 0.2, math.inf), "dual_clip: expected 0 (off) or a finite value"),
        (lambda: ppo_clip_loss(X, torch.zeros(2, 4), X, ONES, 0.2, 0.2), "logprobs, old_logprobs, mask: expected"),
        (lambda: importance_weights(X, X, ONES, 0.5, 2.0, "clip"), "mode: expected one of ('truncate', 'mask')"),
        (lambda: importance_weights(X, X, ONES, 0.0, 2.0, "mask"), "low, high: expected 0 < low <= 1 <= high"),
        (lambda: importance_weights(X, X, ONES, 1.2, 2.0, "mask"), "got low=1.2, high=2.0"),
        (lambda: importance_weights(X, X, ONES, 0.5, 0.9, "mask"), "got low=0.5, high=0.9"),
        (lambda: kl_to_reference(X, torch.zeros(2)), "logprobs, ref_logprobs: expected [B, T] tensors of one shape"),
        (lambda: entropy_from_log_probs(X), "log_probs: expected a [B, T, V] tensor, got shape (2, 3)"),
        (
            lambda: topk_forward_kl(LOGITS, torch.zeros(2, 4, 2, dtype=torch.int64), torch.zeros(2, 4, 2)),
            "teacher_topk_ids: expected shape [B, T, k] with [B, T] = (2, 3), got (2, 4, 2)",
        ),
        (
            lambda: topk_forward_kl(LOGITS, torch.zeros(2, 3, 2, dtype=torch.int32), torch.zeros(2, 3, 2)),
            "teacher_topk_ids: expected an int64 tensor, got torch.int32",
        ),
        (
            lambda: topk_forward_kl(LOGITS, torch.zeros(2, 3, 2, dtype=torch.int64), torch.zeros(2, 3, 3)),
            "teacher_topk_logprobs: expected shape (2, 3, 2) (as teacher_topk_ids), got (2, 3, 3)",
        ),
        (lambda: topk_forward_kl(X, X.long(), X), "student_logits: expected a [B, T, V] tensor"),
        (lambda: clipped_value_loss(X, X, X, ONES, clip=0.0), "clip: expected > 0, got 0.0"),
        (lambda: clipped_value_loss(X, X, torch.zeros(2, 1), ONES, 0.2), "values, old_values, returns, mask: expected"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(call, message):
    with pytest.raises(ValueError) as excinfo:
        call()
    assert message in str(excinfo.value)
