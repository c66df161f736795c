"""Rewards for math answers: 1.0 when the response's final answer equals the ground truth, else 0.0.

Equivalence is math-verify's (\\frac{1}{2} = 0.5 = 1/2, 42.0 = 42, {1,2} = {2,1}, intervals), run in a
child process (see verify_worker) so that a reward called from a rollout thread can neither raise nor
hang. Responses are cut to their last MAX_RESPONSE_CHARS characters (final answers come last) and
answers longer than MAX_ANSWER_CHARS score 0 without being parsed.

DAPO's reference reward gives -1.0 for a wrong answer; these give 0.0, so every math reward here shares
one {0, 1} scale (what a critic's initial value of about the mean reward assumes). GRPO advantages
scaled by the group's std are unchanged by the shift.
"""

import re

from meshy.recipes.tasks.verify_worker import VerifyWorker

MAX_RESPONSE_CHARS = 16_000
MAX_ANSWER_CHARS = 1_000

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_LINE = re.compile(r"Answer\s*:[ \t]*([^\n]*)", re.IGNORECASE)
_WORKER = VerifyWorker()


def extract_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} or \\fbox{...} (nested and escaped braces allowed); None if
    there is none or it is not closed."""
    text = text[-MAX_RESPONSE_CHARS:]
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # \{ and \} are literal braces
            continue
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return text[starts[-1] : i].strip() or None
        i += 1
    return None


def extract_dapo_answer(text: str) -> str | None:
    """What follows the last "Answer:" (any case) on its line, as DAPO's prompt asks; None if none or empty."""
    matches = _ANSWER_LINE.findall(text[-MAX_RESPONSE_CHARS:])
    if not matches:
        return None
    return matches[-1].strip() or None


def math_verify_reward(response: str, ground_truth: str) -> float:
    """math-verify's own extraction of the final answer (boxed, "final answer is", last expression)."""
    return float(_WORKER.equivalent(_as_latex(ground_truth), response[-MAX_RESPONSE_CHARS:]))


def dapo_reward(response: str, ground_truth: str) -> float:
    """The answer on the last "Answer:" line, compared by equivalence."""
    return float(_equivalent(extract_dapo_answer(response), ground_truth))


def boxed_reward(response: str, ground_truth: str) -> float:
    """The last \\boxed{...} answer, compared by equivalence."""
    return float(_equivalent(extract_boxed(response), ground_truth))


def dapo_answer(ground_truth: str) -> str:
    """A response dapo_reward gives full marks: the ground truth on an "Answer:" line."""
    return f"Answer: {ground_truth}"


def boxed_answer(ground_truth: str) -> str:
    """A response boxed_reward and math_verify_reward give full marks: the ground truth boxed."""
    return f"\\boxed{{{ground_truth}}}"


# What each reward pays full marks for (meshy.recipes.usercode.task_trial): the bare ground truth is not an answer here.
dapo_reward.perfect_response = dapo_answer
boxed_reward.perfect_response = math_verify_reward.perfect_response = boxed_answer


def _equivalent(answer: str | None, truth: str) -> bool:
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return False
    answer = answer.strip().removesuffix(".").strip().strip("$").strip()
    if answer == truth.strip():
        return True
    return _WORKER.equivalent(_as_latex(truth), _as_latex(answer))


def _as_latex(text: str) -> str:
    """Inline math, so math-verify's LaTeX extraction reads the whole string as one expression."""
    return f"${text.strip().strip('$')}$"
