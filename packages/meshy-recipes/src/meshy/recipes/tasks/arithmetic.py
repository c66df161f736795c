"""The embedded default task: single-digit arithmetic, generated and verified locally.

A prompt is `a+b=` (or `a-b=`, `a*b=` with `ops`), written with a character tokenizer; the answer is
the result's digits followed by EOS. The reward is 1 for exactly that, else 0. A model starting from
random weights answers right by chance about 1 time in 17 per token; a tiny Qwen3 learns it with RL.
"""

import operator
import random
from collections.abc import Iterator

from meshy.dataplane import SchemaError
from meshy.recipes.prompts.problem import Problem

PAD, BOS, EOS = 0, 1, 2
_CHARS = "0123456789+-*="
_FIRST = 3
_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class CharTokenizer:
    """Special tokens 0-2, then one id per character of `_CHARS` (vocabulary of 17)."""

    vocab_size = _FIRST + len(_CHARS)
    eos_token_id = EOS
    bos_token_id = BOS

    def encode(self, text: str) -> list[int]:
        try:
            return [BOS] + [_FIRST + _CHARS.index(c) for c in text]
        except ValueError:
            raise SchemaError(f"arithmetic tokenizer: {text!r} has characters outside {_CHARS!r}") from None

    def decode(self, ids: list[int]) -> str:
        return "".join(_CHARS[i - _FIRST] for i in ids if _FIRST <= i < self.vocab_size)


def problems(seed: int, max_operand: int = 4, ops: str = "+") -> Iterator[Problem]:
    """An endless, seeded stream of problems."""
    if not 0 < max_operand <= 9 or not ops or any(op not in "+-*" for op in ops):
        raise SchemaError(f"arithmetic task: max_operand in 1..9 and ops from '+-*', got {max_operand}, {ops!r}")
    rng = random.Random(seed)
    while True:
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        yield Problem(f"{a}{op}{b}=", str(_OPERATORS[op](a, b)))


def tokenizer() -> CharTokenizer:
    return CharTokenizer()


def exact_match(response: str, ground_truth: str) -> float:
    """1.0 when the response (decoded up to EOS) is exactly the answer."""
    return float(response.strip() == ground_truth)
