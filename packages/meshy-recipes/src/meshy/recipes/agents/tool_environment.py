"""What a multi-turn task plugs in: an environment that opens a trajectory and answers each policy turn.

`reset(problem)` gives the conversation the policy starts from (and the tools it may call); `step(text)`
takes the text of one policy turn and gives the tool results to show next, a reward, and whether the
trajectory is done. ToolEnvironment is the usual one: a turn that calls tools gets their results (every
call of a turn runs concurrently), a turn that calls none is the final answer and is scored.

In a run, each step may be taken by another process than the last (meshy.recipes.roles.environment):
a fresh environment is reset to the problem before every step. An environment that keeps state between
steps says so with `state()` (a JSON value) and `restore(state)`: the state after each step travels
with the trajectory and is restored before the next; one without them may depend only on the problem
and the turn's text.
"""

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshy.dataplane import SchemaError
from meshy.recipes.agents.tool_calls import FORMATS, parse_tool_calls
from meshy.recipes.agents.tools import ToolBox, ToolResult
from meshy.recipes.prompts.chat_templates import Message


@dataclass(frozen=True)
class Step:
    results: list[str]  # the tool results to show the policy next (none when done)
    reward: float
    done: bool
    calls: list[ToolResult] = field(default_factory=list)  # what each tool call did, for the run's counts


class Environment(Protocol):
    def tool_schemas(self) -> list[dict]: ...

    async def reset(self, problem: Any) -> list[Message]: ...

    async def step(self, action: str) -> Step: ...


def saved_state(env: Environment) -> Any:
    """The environment's state to carry to its next step (None: it keeps none)."""
    state = getattr(env, "state", None)
    return None if state is None else state()


def restore_state(env: Environment, state: Any) -> None:
    """Put back what `saved_state` gave after the previous step, into an environment just reset."""
    if state is not None:
        env.restore(state)  # type: ignore[attr-defined]


class ToolEnvironment:
    """Poses `prompt(problem)` as the user turn (after `system`, if given, and the `examples`
    conversation, e.g. worked problems that show the policy the tools in use) and scores the final
    answer with `score(answer text, problem)`. A turn with no tool call is the final answer; calls are
    read in `tool_format` (meshy.recipes.agents.tool_calls.FORMATS), the chat template's. call_score: the
    reward of the first turn that calls tools, from its text, what its calls did and the problem (later
    calls earn nothing: a policy is not paid for calling again; no call_score, nothing). perfect_answer: the
    final answer (text before the end of turn) that `score` gives full marks, for a problem; `meshy check`
    tries it (meshy.recipes.usercode.task_trial)."""

    def __init__(
        self,
        tools: ToolBox,
        prompt: Callable[[Any], str],
        score: Callable[[str, Any], float],
        system: str | None = None,
        call_score: Callable[[str, list[ToolResult], Any], float] | None = None,
        tool_format: str = "qwen3",
        examples: Sequence[Message] = (),
        perfect_answer: Callable[[Any], str] | None = None,
    ) -> None:
        if tool_format not in FORMATS:
            raise SchemaError(f"tool_format: unknown tool-call format {tool_format!r}; expected one of {FORMATS}")
        self.tools, self.prompt, self.score, self.system = tools, prompt, score, system
        self.call_score, self.tool_format, self.examples = call_score, tool_format, list(examples)
        self.perfect_answer = perfect_answer
        self._problem: Any = None
        self._called = False  # a turn has called tools (call_score is paid once)

    def tool_schemas(self) -> list[dict]:
        return self.tools.schemas()

    def state(self) -> dict:
        return {"called": self._called}

    def restore(self, state: dict) -> None:
        self._called = bool(state["called"])

    async def reset(self, problem: Any) -> list[Message]:
        self._problem, self._called = problem, False
        system: Sequence[Message] = [Message("system", self.system)] if self.system is not None else []
        return [*system, *self.examples, Message("user", self.prompt(problem))]

    async def step(self, action: str) -> Step:
        calls = parse_tool_calls(action, self.tool_format)
        if not calls:
            return Step([], float(self.score(action, self._problem)), True)
        done = list(await asyncio.gather(*(self.tools.call(call) for call in calls)))
        paid = self.call_score is not None and not self._called
        reward = float(self.call_score(action, done, self._problem)) if paid else 0.0
        self._called = True
        return Step([result.content for result in done], reward, False, done)
