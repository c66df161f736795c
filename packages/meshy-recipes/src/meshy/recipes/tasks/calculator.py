"""A multi-turn task where the tool is needed: multi-digit arithmetic with a calculator tool.

A problem is `a*b=` (or `a+b=`, `a-b=` with `ops`) with `digits`-digit operands: beyond what a tiny
model computes in its head, within what it can copy into a tool call. The policy may call `calculator`
with `{"expression": "a*b"}` in Qwen3's tool-call format, sees the result as a tool response, and ends
with a turn that calls no tool: its text (up to `<|im_end|>`) is the answer, rewarded 1 when it is
exactly the result, else 0.

The calculator evaluates only `integer op integer` (no eval of anything else): what the policy writes
is untrusted, and anything else is an error observation.
"""

import functools
import operator
import random
import re
from collections.abc import Iterator

from meshy.dataplane import SchemaError
from meshy.recipes.agents.environment import ToolEnvironment
from meshy.recipes.agents.tools import Tool, ToolBox
from meshy.recipes.tasks.arithmetic import Problem

_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_EXPRESSION = re.compile(r"\s*(-?\d{1,12})\s*([-+*])\s*(-?\d{1,12})\s*")
END_OF_TURN = "<|im_end|>"


def problems(seed: int, digits: int = 3, ops: str = "*") -> Iterator[Problem]:
    """An endless, seeded stream of problems with operands of exactly `digits` digits."""
    if not 1 <= digits <= 6 or not ops or any(op not in _OPERATORS for op in ops):
        raise SchemaError(f"calculator task: digits in 1..6 and ops from '+-*', got {digits}, {ops!r}")
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits - 1
    while True:
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(ops)
        yield Problem(f"{a}{op}{b}=", str(_OPERATORS[op](a, b)))


def calculate(expression: str) -> str:
    """The value of `integer op integer` (op one of + - *); ValueError for anything else."""
    match = _EXPRESSION.fullmatch(expression)
    if match is None:
        raise ValueError(f"expected an expression like 12*34 (integers and one of + - *), got {expression[:40]!r}")
    a, op, b = match.groups()
    return str(_OPERATORS[op](int(a), int(b)))


CALCULATOR = Tool("calculator", calculate, "Evaluate a+b, a-b or a*b of two integers.", {"expression": "string"})


def answer_reward(final_turn: str, problem: Problem) -> float:
    """1.0 when the final turn's text (up to its end-of-turn marker) is exactly the answer."""
    return float(final_turn.split(END_OF_TURN)[0].strip() == problem.answer)


@functools.cache
def _tools(timeout_s: float) -> ToolBox:
    return ToolBox([CALCULATOR], timeout_s)  # stateless: one per process, shared by every trajectory


def environment(tool_timeout_s: float = 5.0) -> ToolEnvironment:
    """A fresh environment for one trajectory (the task's `environment` entry point)."""
    return ToolEnvironment(_tools(tool_timeout_s), prompt=lambda p: p.prompt, score=answer_reward)
