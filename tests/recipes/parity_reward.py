"""A stand-in reward for miniature runs: the parity of the response's characters. About half of any
model's responses earn 1, so nearly every group's rewards differ and dynamic sampling keeps it: the
trainer steps whatever the model (a tiny random one rarely adds right, and its groups would all be
dropped)."""


def parity_reward(response: str, ground_truth: str) -> float:
    return float(sum(map(ord, response)) % 2)


def answer_parity_reward(response: str, ground_truth: str) -> float:
    """The parity of the right answer, whatever the response: every group's rewards are equal."""
    return float(int(ground_truth) % 2)


# Stand-ins that pay for something else than a right answer: none gets full marks for being right, so
# meshy check does not try them on one (meshy.recipes.usercode.task_trial).
parity_reward.perfect_response = answer_parity_reward.perfect_response = None
