"""A problem, as a task's problem stream yields it: the prompt to pose and the answer it is checked against."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
