"""One multi-turn trajectory, token-exact: the prompt, then the policy's tokens and the observations' tokens
in turn, as one sequence.

Policy tokens are exactly the ids the engine generated (never decoded and encoded again; their text is
decoded only to find tool calls); observation tokens are the ids of the text the chat template writes
between two assistant turns (chat_templates.observation). `policy_mask` marks the policy's tokens; each
has the logprob and weights version the engine reported (observation tokens: 0.0 and NO_VERSION), so a
trajectory that spans a weight update records which version produced each token.

A trajectory ends when the environment says it is done, or at a limit, and is kept either way with its
finish reason: MAX_TURNS (the policy took `max_turns` turns), MAX_TOKENS (the sequence after the prompt
reached `max_tokens`; a turn cut by it is still given to the environment, which scores it as it
stands, as a single-turn run scores a response cut at max_new_tokens), DEADLINE (the whole trajectory
took `deadline_s`; a turn or a step that ends past it is not kept), ABORTED (the engine aborted a turn:
it was closed), ERROR (the engine could not generate a turn; `error` says why).

`take_turn` is one step: record a policy turn and the environment's answer. `run_trajectory` loops it
in one process; the environment role (meshy.recipes.roles.environment) takes each step as a row of
the data plane's `turns` table, in whichever of its processes leases it. The deadline counts wall-clock
time from `started`, so it holds across processes.
"""

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshy.dataplane import SchemaError
from meshy.infer.engine import FINISH_LENGTH, FINISH_STOP, Generation
from meshy.recipes.agents.tool_environment import Environment, saved_state
from meshy.recipes.prompts.chat_templates import observation, render

DONE, MAX_TURNS, MAX_TOKENS, DEADLINE, ABORTED = "done", "max-turns", "max-tokens", "deadline", "aborted"
ERROR = "error"  # the engine's finish reason for a turn it could not generate (the inference service's)
NO_VERSION = -1  # the weights version of an observation token (no policy produced it)
TURN_LIMIT = 1000  # the most turns a trajectory may take (max_turns)

# (input ids, max new tokens) -> the engine's generation of one policy turn
Generate = Callable[[list[int], int], Awaitable[Generation]]


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...  # no special tokens added: ids of exactly `text`

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int
    max_tokens: int  # policy and observation tokens after the prompt
    deadline_s: float

    def __post_init__(self) -> None:
        if not 1 <= self.max_turns <= TURN_LIMIT or self.max_tokens < 1 or not self.deadline_s > 0:
            raise SchemaError(
                f"agent limits: expected max_turns in 1..{TURN_LIMIT}, max_tokens >= 1 and deadline_s > 0, got "
                f"{self.max_turns!r}, {self.max_tokens!r}, {self.deadline_s!r}"
            )


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)  # policy and observation tokens, in order
    policy_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    finish_reason: str = ""
    turns: int = 0  # policy turns taken
    tool_calls: Counter = field(default_factory=Counter)  # by tool name ("" for malformed calls)
    tool_errors: Counter = field(default_factory=Counter)  # by kind (meshy.recipes.agents.tools)
    tool_seconds: list[float] = field(default_factory=list)
    error: str = ""  # why the engine could not generate a turn (finish reason ERROR)
    started: float = field(default_factory=time.time)  # wall clock: the deadline counts from here
    environment_state: Any = None  # what the environment keeps between steps (environment.saved_state)

    def budget(self, limits: AgentLimits) -> int:
        """Tokens the next turn may generate."""
        return limits.max_tokens - len(self.response_ids)

    def _append(self, ids: list[int], policy: bool, logprobs: list[float], versions: list[int]) -> None:
        self.response_ids += ids
        self.policy_mask += [policy] * len(ids)
        self.logprobs += logprobs
        self.token_versions += versions


async def run_trajectory(
    env: Environment,
    problem: Any,
    generate: Generate,
    tokenizer: Tokenizer,
    template: str,
    limits: AgentLimits,
    enable_thinking: bool | None = None,
) -> Trajectory:
    """Play one trajectory of `env` on `problem` with the policy behind `generate`."""
    trajectory = await open_trajectory(env, problem, tokenizer, template, enable_thinking)
    try:
        async with asyncio.timeout(limits.deadline_s):
            going = True
            while going:
                turn = await generate(trajectory.prompt_ids + trajectory.response_ids, trajectory.budget(limits))
                going = await take_turn(trajectory, turn, env, tokenizer, template, limits, enable_thinking)
    except TimeoutError:
        trajectory.finish_reason = DEADLINE
    return trajectory


async def open_trajectory(
    env: Environment, problem: Any, tokenizer: Tokenizer, template: str, enable_thinking: bool | None = None
) -> Trajectory:
    """A new trajectory: `env` reset to `problem`, its conversation and tools rendered as the prompt."""
    messages = await env.reset(problem)
    prompt = render(template, messages, tools=env.tool_schemas(), enable_thinking=enable_thinking)
    return Trajectory(tokenizer.encode(prompt))


async def take_turn(
    trajectory: Trajectory,
    turn: Generation,
    env: Environment,
    tokenizer: Tokenizer,
    template: str,
    limits: AgentLimits,
    enable_thinking: bool | None = None,
    error: str = "",
) -> bool:
    """Record one policy turn (`turn`, generated from the trajectory so far) and the environment's answer
    to it. True while the trajectory goes on; once it has ended, its finish_reason says why. error: the
    engine's reason when it could not generate the turn (finish reason ERROR)."""
    left = trajectory.started + limits.deadline_s - time.time()
    if left <= 0:
        trajectory.finish_reason = DEADLINE
        return False
    trajectory._append(turn.output_ids, True, turn.logprobs, turn.token_versions)
    trajectory.turns += 1
    if turn.finish_reason not in (FINISH_STOP, FINISH_LENGTH):  # aborted, or the engine failed
        trajectory.error = error
        trajectory.finish_reason = ERROR if turn.finish_reason == ERROR else ABORTED
        return False
    try:
        async with asyncio.timeout(left):
            step = await env.step(tokenizer.decode(turn.output_ids))
    except TimeoutError:
        trajectory.finish_reason = DEADLINE
        return False
    trajectory.reward += step.reward
    trajectory.environment_state = saved_state(env)
    for call in step.calls:
        trajectory.tool_calls[call.name] += 1
        trajectory.tool_seconds.append(call.seconds)
        if call.error is not None:
            trajectory.tool_errors[call.error] += 1
    if turn.finish_reason == FINISH_LENGTH:  # cut by the token budget: scored as it stands, and the last
        trajectory.finish_reason = MAX_TOKENS
    elif step.done:
        trajectory.finish_reason = DONE
    elif trajectory.turns >= limits.max_turns:
        trajectory.finish_reason = MAX_TURNS
    else:
        shown = tokenizer.encode(observation(template, step.results, enable_thinking=enable_thinking))
        if len(trajectory.response_ids) + len(shown) >= limits.max_tokens:  # no room for another turn
            trajectory.finish_reason = MAX_TOKENS
        else:
            trajectory._append(shown, False, [0.0] * len(shown), [NO_VERSION] * len(shown))
    return not trajectory.finish_reason
