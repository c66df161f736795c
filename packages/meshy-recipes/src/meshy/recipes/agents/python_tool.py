"""A `python` tool: runs its `code` argument in the sandbox (meshy.recipes.agents.sandbox) and gives back
what the code printed.

Code that ends on its own with status 0 gives its stdout (and its stderr, after a `[stderr]` line, when
there is any). Everything else is an error observation with the output so far: code that ran past its
wall-clock limit is a TIMEOUT, code stopped at its CPU-time or output limit is KILLED, and code that exited
with another status (an uncaught exception, MemoryError at the memory limit included) is RAISED.

Give the tool box a timeout above `wall_s` (plus a second for start-up and the stop), so the sandbox's own
limit is the one that ends a slow call; a box timeout that comes first also stops the sandbox.
"""

import signal

from meshy.recipes.agents.sandbox import (
    CPU_TIME,
    OUTPUT,
    WALL_CLOCK,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    check_sandbox,
    run_python,
)
from meshy.recipes.agents.tools import KILLED, RAISED, TIMEOUT, Tool, ToolError

DESCRIPTION = (
    "Run Python 3 code (the standard library's math, fractions, decimal, statistics, itertools, re, json and "
    "the like; no network, no packages) and return what it prints. Print the values you need."
)


def python_tool(limits: SandboxLimits) -> Tool:
    """The tool, each call a sandbox with `limits`; SandboxUnavailable, now, if this machine cannot build
    the sandbox (code is never run without it)."""
    if (why := check_sandbox()) is not None:
        raise SandboxUnavailable(f"the python tool runs code only in the sandbox: {why}")

    async def python(code: str) -> str:
        return observation(await run_python(code, limits), limits)

    return Tool("python", python, DESCRIPTION, {"code": "string"})


def observation(result: SandboxResult, limits: SandboxLimits) -> str:
    """What the model sees of a run: its output, or a ToolError saying how it ended, with its output."""
    output = result.stdout + (f"\n[stderr]\n{result.stderr}" if result.stderr else "")
    if result.killed == WALL_CLOCK:
        raise ToolError(TIMEOUT, f"the code ran past its {limits.wall_s:g} s and was stopped; output:\n{output}")
    if result.killed == CPU_TIME:
        raise ToolError(KILLED, f"the code used its {limits.cpu_s} s of CPU time and was stopped; output:\n{output}")
    if result.killed == OUTPUT:
        limit = limits.max_output_bytes
        raise ToolError(KILLED, f"the code printed more than {limit} bytes and was stopped; output:\n{output}")
    status = result.exit_status
    if status is not None and status > 0:
        raise ToolError(RAISED, f"the code exited with status {status}; output:\n{output}")
    if status is not None and status < 0:
        raise ToolError(
            RAISED, f"the code was ended by signal {-status} ({signal.strsignal(-status)}); output:\n{output}"
        )
    return output
