"""A task of your own: reverse a 3-letter string ("abc=" -> "cba").

A task is three things a recipe names by import path (its [task] section): a tokenizer factory, a
problem stream and a reward function. Nothing else of Meshy needs to change.
"""

import random
from collections.abc import Iterator
from dataclasses import dataclass

from meshy.dataplane import SchemaError

# The ids the model knows as special: qwen3-tiny's bos_token_id is 1 and eos_token_id 2, and the engine
# stops a response at the model's EOS, so the tokenizer's must be the same id.
PAD, BOS, EOS = 0, 1, 2
LETTERS = "abcdefghijklmnopqrstuvwxyz"
_CHARS = LETTERS + "="
_FIRST = 3  # the first character's id


class LetterTokenizer:
    """One id per character: 3 special ids, then a-z and "=" (a vocabulary of 30: the recipe sets
    model.overrides.vocab_size to it)."""

    vocab_size = _FIRST + len(_CHARS)
    bos_token_id = BOS
    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        """The prompt's ids, BOS first: Meshy adds no special token of its own."""
        unknown = sorted(set(text) - set(_CHARS))
        if unknown:
            raise SchemaError(f"reverse tokenizer: {text!r} has characters outside a-z and '=': {unknown}")
        return [BOS] + [_FIRST + _CHARS.index(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        """The text of a response (Meshy cuts it at EOS first); ids that are no character decode to nothing."""
        return "".join(_CHARS[i - _FIRST] for i in ids if _FIRST <= i < self.vocab_size)


def tokenizer() -> LetterTokenizer:
    """[task] tokenizer: called with the recipe's task.tokenizer_options (none here)."""
    return LetterTokenizer()


@dataclass(frozen=True)
class Problem:
    prompt: str  # what the policy sees, encoded by the tokenizer
    answer: str  # the ground truth the reward gets


def problems(seed: int, letters: str = "abcde", length: int = 3) -> Iterator[Problem]:
    """[task] problems: an endless stream, the same for the same seed. Called with the run's seed and
    the recipe's task.options (here `letters` and `length`)."""
    if not letters or not set(letters) <= set(LETTERS) or not 1 <= length <= 8:
        raise SchemaError(f"reverse task: letters from a-z and length in 1..8, got {letters!r}, {length}")
    rng = random.Random(seed)
    while True:
        word = "".join(rng.choice(letters) for _ in range(length))
        yield Problem(f"{word}=", word[::-1])


def reward(response: str, ground_truth: str) -> float:
    """[task] reward: the share of letters in place, so 1.0 only for exactly the reversed string (a
    longer or shorter response shares its length with the count)."""
    response = response.strip()
    in_place = sum(a == b for a, b in zip(response, ground_truth, strict=False))
    return in_place / max(len(response), len(ground_truth))
