"""A stand-in reward for end-to-end runs of real models: the response's length in characters / 1000. It
differs within nearly every group, so GRPO advantages, and the gradients of a step, are not all zero
(a 135M model almost never solves the math task, whose reward then is 0 everywhere)."""


def length_reward(response: str, ground_truth: str) -> float:
    return len(response) / 1000


length_reward.perfect_response = None  # it pays for length, not for a right answer (meshy.recipes.usercode.task_trial)
