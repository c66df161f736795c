"""Math with a Python tool: a multi-turn task where the policy may run code to compute before it answers.

    [task]
    problems = "meshy.recipes.tasks.python_math:problems"
    options = { source = "BytedTsinghua-SIA/DAPO-Math-17k:data/dapo-math-17k.parquet", format = "dapo" }
    environment = "meshy.recipes.tasks.python_math:environment"
    environment_options = { reward = "dapo" }

Problems are the math task's (meshy.recipes.tasks.math: generated, or a data file's records); the
environment poses each question with `instruction`, offers the `python` tool (meshy.recipes.agents.
python_tool: every call a fresh sandbox with `cpu_s` of CPU time and `memory_mb` of address space, and
a wall-clock limit a little under the recipe's agent.tool_timeout_s) and scores the turn that calls no
tool with `reward` (math_reward: "boxed", "dapo" or "math-verify"), its end of turn left out (a "dapo"
answer runs to the end of its line: "Answer: \\frac{1}{2}<|im_end|>" would not be \\frac{1}{2}). The sandbox
must be available on the machine (meshy.recipes.agents.sandbox): a run on one that refuses it fails at start,
saying why.
"""

import functools
from collections.abc import Iterator

from meshy.dataplane import SchemaError
from meshy.recipes.agents.python_tool import python_tool
from meshy.recipes.agents.sandbox import SandboxLimits
from meshy.recipes.agents.tool_environment import ToolEnvironment
from meshy.recipes.agents.tools import ToolBox
from meshy.recipes.prompts.problem import Problem
from meshy.recipes.tasks import math, math_reward

INSTRUCTION = "{question}\n\nYou may run Python code with the python tool to compute; print what you need to see."
REWARDS = {
    "boxed": math_reward.boxed_reward,
    "dapo": math_reward.dapo_reward,
    "math-verify": math_reward.math_verify_reward,
}
END_OF_TURN = "<|im_end|>"  # Qwen3's: the final turn's text ends with it, which is not part of the answer
STOP_S = 2.0  # the tool's timeout minus the sandbox's wall clock: start-up and the stop of a slow call


def problems(
    seed: int, source: str = math.GENERATED, format: str | None = None, domain: str | None = None
) -> Iterator[Problem]:
    """The questions and answers of the math task's `source` (prompts are rendered by the environment)."""
    return (Problem(r.question, r.answer) for r in math.records(seed, source, format, domain))


@functools.cache
def _tools(tool_timeout_s: float, cpu_s: int, memory_mb: int) -> ToolBox:
    """One box per process, shared by every trajectory's environment (the tool keeps no state)."""
    if not tool_timeout_s > STOP_S + 1:
        raise SchemaError(
            f"agent.tool_timeout_s: the python tool runs each call for up to tool_timeout_s - {STOP_S:g} s; "
            f"expected more than {STOP_S + 1:g}, got {tool_timeout_s}"
        )
    limits = SandboxLimits(cpu_s=cpu_s, memory_bytes=memory_mb << 20, wall_s=tool_timeout_s - STOP_S)
    return ToolBox([python_tool(limits)], tool_timeout_s)


def environment(
    tool_timeout_s: float = 10.0,
    reward: str = "boxed",
    instruction: str = INSTRUCTION,
    cpu_s: int = 5,
    memory_mb: int = 1024,
) -> ToolEnvironment:
    """A fresh environment for one trajectory (the task's `environment` entry point)."""
    if reward not in REWARDS:
        raise SchemaError(f"task.environment_options.reward: expected one of {sorted(REWARDS)}, got {reward!r}")
    if "{question}" not in instruction:
        raise SchemaError(
            f"task.environment_options.instruction: expected text containing {{question}}, got {instruction!r}"
        )
    score = REWARDS[reward]
    return ToolEnvironment(
        _tools(tool_timeout_s, cpu_s, memory_mb),
        prompt=lambda p: instruction.replace("{question}", p.prompt),
        score=lambda text, p: score(text.removesuffix(END_OF_TURN), p.answer),
        perfect_answer=lambda p: score.perfect_response(p.answer),
    )
