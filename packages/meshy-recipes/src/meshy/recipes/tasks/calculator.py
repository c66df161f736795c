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
that calls the tool is 8 ids for two-digit operands. `partial_credit` shapes the reward for learning
from chance (as tool-learning RL commonly does: credit for the call's format and arguments): a turn
that opens with a call of the calculator earns up to CALL_CREDIT (a quarter for the call, half by how
many of the problem's digits it copied in place, a quarter for a turn that is the call alone, closed,
ended and answered), once per trajectory, and a final answer that is not exact up to PARTIAL_ANSWER by
its digits in place, in the right answer or in the calculator's last result (a policy learns to carry
the result into its answer while it still learns to write the call). An exact answer earns 1 and
nothing else does; `tool=False` poses the same problems without the tool (the baseline: the same reward for
answers, and no calculator to call or be paid for calling).

A pretrained model that was not tuned to call tools (SmolLM2-135M-Instruct: its tuning data has no
function calling) calls them once shown how: `examples` worked problems come before the problem, each a
user turn, the call written in `tool_format` (the chat template's), the tool's result and the answer.
"""

import functools
import itertools
import operator
import random
import re
from collections.abc import Iterator

from meshy.dataplane import SchemaError
from meshy.recipes.agents.environment import Step, ToolEnvironment
from meshy.recipes.agents.tool_calls import ToolCall, write_tool_calls
from meshy.recipes.agents.tools import Tool, ToolBox, ToolResult
from meshy.recipes.tasks.arithmetic import Problem
from meshy.recipes.tasks.chat_templates import Message, observation, render
from meshy.recipes.tasks.piece_tokenizer import PieceTokenizer

_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_EXPRESSION = re.compile(r"\s*(-?\d{1,12})\s*([-+*])\s*(-?\d{1,12})\s*")
END_OF_TURN = "<|im_end|>"
CALL_CREDIT = 0.2  # partial credit: the most a turn calling the calculator earns
PARTIAL_ANSWER = 0.2  # partial credit: the most a final answer that is not exact earns
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


def in_place(text: str, target: str) -> float:
    """The share of `target`'s digits that `text` has in place, over the longer of the two (a policy is
    not paid for what every problem has in the same place, such as the operator)."""
    digits = [i for i, c in enumerate(target) if c.isdigit()]
    hits = sum(i < len(text) and text[i] == target[i] for i in digits)
    return hits / max(len(digits) + len(text) - len(target), len(digits), 1)


def partial_answer_reward(final_turn: str, problem: Problem, shown: str = "") -> float:
    """1.0 for exactly the answer; else up to PARTIAL_ANSWER, by the answer's digits in place in the right
    answer or in `shown`, the calculator's last result (so a policy learns to carry the result into its
    answer while it still learns to write the call right)."""
    answer = final_turn.split(END_OF_TURN)[0].strip()
    if answer == problem.answer:
        return 1.0
    return PARTIAL_ANSWER * max(in_place(answer, problem.answer), in_place(answer, shown) if shown else 0.0)


def call_credit(action: str, results: list[ToolResult], problem: Problem) -> float:
    """Up to CALL_CREDIT for a turn that opens with a call of the calculator: a quarter for the call as
    the tool's format writes it, half by the share of the problem's digits the argument has in place
    (nothing for a call the calculator merely answered: a policy paid for any valid expression settles
    on one it can write without reading the problem), and a quarter for a turn that is the call alone,
    closed, ended and answered (a policy paid for a call it never closed wrote on until the turn was cut;
    one paid for the digits alone wrote any character between them)."""
    if not action.startswith(CALL_OPEN):
        return 0.0
    argument = action.removeprefix(CALL_OPEN).split('"', 1)[0]
    answered = len(results) == 1 and results[0].error is None
    complete = answered and action == CALL_OPEN + argument + CALL_CLOSE + END_OF_TURN
    return CALL_CREDIT * (0.25 + 0.5 * in_place(argument, problem.prompt.removesuffix("=")) + 0.25 * complete)


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
    )


class CalculatorEnvironment(ToolEnvironment):
    """A ToolEnvironment that remembers the calculator's last result it showed (part of its state), for
    the partial credit of an answer."""

    def __init__(self, *args, partial_credit: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if partial_credit:
            self.score = lambda answer, problem: partial_answer_reward(answer, problem, self._shown)
        self._shown = ""

    def state(self) -> dict:
        return {**super().state(), "shown": self._shown}

    def restore(self, state: dict) -> None:
        super().restore(state)
        self._shown = str(state["shown"])

    async def reset(self, problem: Problem) -> list[Message]:
        self._shown = ""
        return await super().reset(problem)

    async def step(self, action: str) -> Step:
        step = await super().step(action)
        if step.calls:
            self._shown = step.calls[-1].content if step.calls[-1].error is None else ""
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
