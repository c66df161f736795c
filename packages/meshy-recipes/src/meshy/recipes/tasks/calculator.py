"""A multi-turn task where the tool is needed: multi-digit arithmetic with a calculator tool.

A problem is `a*b=` (or `a+b=`, `a-b=` with `ops`) with `digits`-digit operands: beyond what a tiny
model computes in its head, within what it can copy into a tool call. The policy may call `calculator`
with `{"expression": "a*b"}` in Qwen3's tool-call format, sees the result as a tool response, and ends
with a turn that calls no tool: its text (up to `<|im_end|>`) is the answer, rewarded 1 when it is
exactly the result, else 0.

The calculator evaluates only `integer op integer` (no eval of anything else): what the policy writes
is untrusted, and anything else is an error observation.

For a model built from scratch, `tokenizer()` makes each string the
conversation repeats one id (the system turn listing the tool, the turn markers, the tool call's JSON
around its expression, the tool response's wrapping): the text is Qwen3's template exactly, and a turn
that calls the tool is 8 ids for two-digit operands. Products are of operands whose product always has
twice their digits (32..99 for two), so an answer's length never gives it away.

`partial_credit` shapes the reward for learning from chance (as tool-learning RL commonly does: credit
for the call's format and arguments). The first turn that opens with a call of the calculator earns up to
CALL_CREDIT: a tenth for the call's opening as the tool's format writes it, seven tenths by the share of
the problem's expression its argument has in place, a tenth for closing the call and a tenth for ending
the turn there (with the end-of-turn id: `split_turn`). A final answer that is not exact earns up to
ANSWER_CREDIT (by its characters in place in the right answer, and for ending the turn after them), but
only once the calculator has given the answer (a call that computed the problem's result): a policy paid
for near answers without calling learns to guess, not to call, and one paid after any call is paid for
digits its call's result did not hold, noise on the credit for copying the expression. An exact answer
makes the trajectory's reward 1 whatever it was paid before, and nothing else reaches 1. `tool=False`
poses the same problems without the tool (the baseline: the same reward for answers, always paid, and
no calculator to call or be paid for calling).

A pretrained model that was not tuned to call tools (SmolLM2-135M-Instruct: its tuning data has no
function calling) calls them once shown how: `examples` worked problems come before the problem, each a
user turn, the call written in `tool_format` (the chat template's), the tool's result and the answer.
"""

import dataclasses
import functools
import itertools
import math
import operator
import random
import re
from collections.abc import Iterator

from meshy.dataplane import SchemaError
from meshy.recipes.agents.tool_calls import ToolCall, write_tool_calls
from meshy.recipes.agents.tool_environment import Step, ToolEnvironment
from meshy.recipes.agents.tools import Tool, ToolBox, ToolResult
from meshy.recipes.prompts.chat_templates import Message, observation, render
from meshy.recipes.prompts.problem import Problem
from meshy.recipes.tasks.piece_tokenizer import PieceTokenizer

_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_EXPRESSION = re.compile(r"\s*(-?\d{1,12})\s*([-+*])\s*(-?\d{1,12})\s*")
END_OF_TURN = "<|im_end|>"
CALL_CREDIT = 0.2  # partial credit: the most a turn calling the calculator earns
ANSWER_CREDIT = 0.2  # partial credit: the most a final answer that is not exact earns
CALL_OPEN = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'  # Qwen3's call, up to the argument
CALL_CLOSE = '"}}\n</tool_call>'
_MARK = "\x00"  # where the problem goes, to split a rendered template into its fixed pieces
EXAMPLES_SEED = 12345  # the worked examples' problems (3-digit products, as the default problems)
MAX_EXAMPLES = 8


def problems(seed: int, digits: int = 3, ops: str = "*") -> Iterator[Problem]:
    """An endless, seeded stream of problems with operands of exactly `digits` digits."""
    if not 1 <= digits <= 6 or not ops or any(op not in _OPERATORS for op in ops):
        raise SchemaError(f"calculator task: digits in 1..6 and ops from '+-*', got {digits}, {ops!r}")
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits - 1
    low_factor = math.isqrt(10 ** (2 * digits - 1) - 1) + 1  # the least whose square has 2 * digits digits
    while True:
        op = rng.choice(ops)
        least = low_factor if op == "*" else low
        a, b = rng.randint(least, high), rng.randint(least, high)
        yield Problem(f"{a}{op}{b}=", str(_OPERATORS[op](a, b)))


def calculate(expression: str) -> str:
    """The value of `integer op integer` (op one of + - *); ValueError for anything else."""
    match = _EXPRESSION.fullmatch(expression)
    if match is None:
        raise ValueError(f"expected an expression like 12*34 (integers and one of + - *), got {expression[:40]!r}")
    a, op, b = match.groups()
    return str(_OPERATORS[op](int(a), int(b)))


CALCULATOR = Tool("calculator", calculate, "Evaluate a+b, a-b or a*b of two integers.", {"expression": "string"})


def split_turn(turn: str) -> tuple[str, bool]:
    """A turn's text before its end-of-turn marker, and whether the turn ended there: the marker is the
    turn's last text. The engine stops a turn at its end-of-turn id, so a turn whose marker has text after
    it did not end: it wrote some other id whose text begins with the marker (a piece tokenizer has the
    prompt's "<|im_end|>\\n<|im_start|>assistant\\n" as one id) and ran on to its token budget."""
    before, marker, after = turn.partition(END_OF_TURN)
    return before, bool(marker) and not after


def answer_reward(final_turn: str, problem: Problem) -> float:
    """1.0 when the final turn is exactly the answer (surrounding whitespace aside) and ended after it."""
    answer, ended = split_turn(final_turn)
    return float(ended and answer.strip() == problem.answer)


def in_place(text: str, target: str) -> int:
    """How many of `target`'s characters `text` has in the same place."""
    return sum(a == b for a, b in zip(text, target, strict=False))


def partial_answer_reward(final_turn: str, problem: Problem) -> float:
    """1.0 for exactly the answer; else up to ANSWER_CREDIT, by the answer's characters in place and for
    ending the turn right after them."""
    if answer_reward(final_turn, problem):
        return 1.0
    answer, ended = split_turn(final_turn)
    answer, target = answer.strip(), problem.answer
    return ANSWER_CREDIT * (0.8 * in_place(answer, target) / max(len(answer), len(target)) + 0.2 * ended)


def call_credit(action: str, results: list[ToolResult], problem: Problem) -> float:
    """Up to CALL_CREDIT for a turn that opens with a call of the calculator (see the module's doc): by the
    share of the expression's characters its argument has in place, over the longer of the two (so the
    operator counts, and extra characters cost), and for a call closed and a turn ended right after it."""
    if not action.startswith(CALL_OPEN):
        return 0.0
    expression = problem.prompt.removesuffix("=")
    argument, quote, rest = action.removeprefix(CALL_OPEN).partition('"')
    closed = bool(quote) and (quote + rest).startswith(CALL_CLOSE)
    ended = closed and (quote + rest).removeprefix(CALL_CLOSE) == END_OF_TURN
    copied = in_place(argument, expression) / max(len(argument), len(expression))
    return CALL_CREDIT * (0.1 + 0.7 * copied + 0.1 * closed + 0.1 * ended)


@functools.cache
def _tools(timeout_s: float, tool: bool) -> ToolBox:
    return ToolBox([CALCULATOR] if tool else [], timeout_s)  # stateless: one per process, for every trajectory


def environment(
    tool_timeout_s: float = 5.0,
    tool: bool = True,
    partial_credit: bool = False,
    tool_format: str = "qwen3",
    examples: int = 0,
) -> ToolEnvironment:
    """A fresh environment for one trajectory (the task's `environment` entry point). tool: whether the
    calculator is there to call; partial_credit: the shaped reward; examples: worked problems shown
    first, their calls written in tool_format (see the module's doc)."""
    if partial_credit and tool and tool_format != "qwen3":
        raise SchemaError(f"partial_credit: the call credit reads Qwen3's tool-call format, got {tool_format!r}")
    if not isinstance(examples, int) or not 0 <= examples <= MAX_EXAMPLES or (examples and not tool):
        raise SchemaError(
            f"examples: expected 0..{MAX_EXAMPLES} worked problems (0 without the tool), got {examples!r}"
        )
    return CalculatorEnvironment(
        _tools(tool_timeout_s, tool),
        prompt=lambda p: p.prompt,
        score=answer_reward,
        call_score=call_credit if partial_credit and tool else None,
        tool_format=tool_format,
        examples=worked_examples(examples, tool_format),
        partial_credit=partial_credit,
        perfect_answer=operator.attrgetter("answer"),
    )


class CalculatorEnvironment(ToolEnvironment):
    """A ToolEnvironment that pays partial credit as the module's doc says: it remembers (in its state)
    whether the calculator has given the answer, and what the trajectory has been paid so far, so that an
    exact answer brings the total to 1."""

    def __init__(self, *args, partial_credit: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if partial_credit:
            self.score = self._partial_answer_reward
        self._paid, self._answered = 0.0, False

    def _partial_answer_reward(self, final_turn: str, problem: Problem) -> float:
        if self._answered or not self.tools.schemas():
            return partial_answer_reward(final_turn, problem)
        return answer_reward(final_turn, problem)

    def state(self) -> dict:
        return {**super().state(), "paid": self._paid, "answered": self._answered}

    def restore(self, state: dict) -> None:
        super().restore(state)
        self._paid, self._answered = float(state["paid"]), bool(state["answered"])

    async def reset(self, problem: Problem) -> list[Message]:
        self._paid, self._answered = 0.0, False
        return await super().reset(problem)

    async def step(self, action: str) -> Step:
        step, problem = await super().step(action), self._problem
        self._answered = self._answered or any(c.error is None and c.content == problem.answer for c in step.calls)
        if step.done and step.reward == 1.0:  # exact: the total is 1
            step = dataclasses.replace(step, reward=1.0 - self._paid)
        self._paid += step.reward
        return step


@functools.cache
def worked_examples(count: int, tool_format: str) -> tuple[Message, ...]:
    """`count` problems solved with the calculator, as conversation turns."""
    turns: list[Message] = []
    for problem in itertools.islice(problems(EXAMPLES_SEED), count):
        call = ToolCall(CALCULATOR.name, {"expression": problem.prompt.removesuffix("=")})
        turns += [
            Message("user", problem.prompt),
            Message("assistant", write_tool_calls([call], tool_format)),
            Message("tool", problem.answer),
            Message("assistant", problem.answer),
        ]
    return tuple(turns)


def tokenizer(template: str = "qwen3", digits_per_piece: int = 1) -> PieceTokenizer:
    """The pieces of the calculator's conversations in `template` (with and without the tool listed, with
    and without Qwen3's empty thinking block), one id each, then the characters of problems and answers.
    digits_per_piece: numbers split into pieces of up to this many digits, left to right (Llama 3's
    tokenizer groups up to 3), so that copying a two-digit operand is copying one id."""
    if digits_per_piece not in (1, 2, 3):
        raise SchemaError(f"tokenizer_options.digits_per_piece: expected 1, 2 or 3, got {digits_per_piece!r}")
    pieces = ["<|endoftext|>", "<|im_start|>", END_OF_TURN, "<think>\n\n</think>\n\n"]
    for tools in ([CALCULATOR.schema()], []):
        head, tail = render(template, [Message("user", _MARK)], tools=tools).split(_MARK)
        pieces += [head, tail]
    pieces += [*observation(template, [_MARK]).split(_MARK), CALL_OPEN, CALL_CLOSE]
    pieces += list("0123456789+-*= \n?")
    for width in range(2, digits_per_piece + 1):
        pieces += [str(n).zfill(width) for n in range(10**width)]
    return PieceTokenizer(list(dict.fromkeys(pieces)), bos="<|endoftext|>", eos=END_OF_TURN, unknown="?")
