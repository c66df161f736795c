"""Tools a policy may call: plain Python callables registered with a name and their arguments' JSON types,
run with a per-call timeout.

Whatever goes wrong in a call (an unknown tool, missing or mistyped arguments, a malformed call, a tool
that raises, hangs past its timeout, or returns something that is not text or JSON) gives a ToolResult
whose content is an error observation for the model and whose `error` names the kind, for the run's
counts; nothing raises into the trajectory, so one bad call never stops a batch.

A synchronous tool runs on the tool box's own threads. A thread cannot be killed, so a synchronous tool
that hangs keeps its thread after its call has timed out (the box has `max_threads`; once all are held,
further synchronous calls time out too, and asynchronous tools are unaffected). Tools that run untrusted
code belong in a separate, killable process (meshy.recipes.agents.python_tool).
"""

import asyncio
import inspect
import json
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from meshy.dataplane import SchemaError
from meshy.recipes.agents.tool_calls import MalformedToolCall, ToolCall

JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")

# ToolResult.error: why a call gave an error observation (None: it did not)
MALFORMED = "malformed"
UNKNOWN_TOOL = "unknown-tool"
BAD_ARGUMENTS = "bad-arguments"
RAISED = "raised"
TIMEOUT = "timeout"
BAD_RESULT = "bad-result"
KILLED = "killed"  # the tool's process was stopped at a limit other than time (CPU time, output)


class ToolError(Exception):
    """What a tool raises to give an error observation of a kind other than RAISED (e.g. TIMEOUT, KILLED);
    the message is the observation."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Tool:
    """fn(**arguments) -> text or a JSON value; sync or async. parameters: argument -> JSON type (one of
    JSON_TYPES); every argument is required."""

    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict[str, str]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise SchemaError(f"Tool.name: expected a name of letters, digits, _ . - (<= 64), got {self.name!r}")
        if not callable(self.fn):
            raise SchemaError(f"Tool {self.name!r} fn: expected a callable, got {type(self.fn).__name__}")
        for argument, kind in self.parameters.items():
            if kind not in JSON_TYPES:
                raise SchemaError(
                    f"Tool {self.name!r} parameters[{argument!r}]: expected one of {list(JSON_TYPES)}, got {kind!r}"
                )

    def schema(self) -> dict:
        """The tool as chat templates list it (OpenAI's function format, which Qwen3's template shows)."""
        properties = {argument: {"type": kind} for argument, kind in self.parameters.items()}
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {"type": "object", "properties": properties, "required": list(self.parameters)},
            },
        }

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """Why `arguments` do not fit the parameters, or None."""
        missing = [a for a in self.parameters if a not in arguments]
        unknown = sorted(arguments.keys() - self.parameters.keys())
        if missing or unknown:
            return f"{self.name} takes arguments {list(self.parameters)}; missing {missing}, unknown {unknown}"
        for argument, kind in self.parameters.items():
            value = arguments[argument]
            if not isinstance(value, JSON_TYPES[kind]) or (isinstance(value, bool) and kind != "boolean"):
                return f"{self.name}: argument {argument!r} must be {kind}, got {json.dumps(value)[:80]}"
        return None


@dataclass(frozen=True)
class ToolResult:
    name: str  # the tool called ("" for a malformed call)
    content: str  # what the model sees: the tool's output, or the error observation
    error: str | None  # None, or one of MALFORMED, UNKNOWN_TOOL, BAD_ARGUMENTS, RAISED, TIMEOUT, BAD_RESULT, KILLED
    seconds: float


class ToolBox:
    """The tools of one environment, each call bounded by `timeout_s` and its result by `max_result_chars`
    (longer output is cut, saying how much was cut)."""

    def __init__(
        self, tools: Sequence[Tool], timeout_s: float, max_result_chars: int = 4096, max_threads: int = 16
    ) -> None:
        if not timeout_s > 0 or max_result_chars < 1 or max_threads < 1:
            raise SchemaError(
                f"ToolBox: expected timeout_s > 0, max_result_chars >= 1 and max_threads >= 1, "
                f"got {timeout_s!r}, {max_result_chars!r}, {max_threads!r}"
            )
        self.tools = {tool.name: tool for tool in tools}
        if len(self.tools) != len(tools):
            raise SchemaError(f"ToolBox: tool names must be unique, got {[tool.name for tool in tools]}")
        self.timeout_s = timeout_s
        self.max_result_chars = max_result_chars
        self._threads = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="meshy-tool")

    def schemas(self) -> list[dict]:
        return [tool.schema() for tool in self.tools.values()]

    async def call(self, call: ToolCall | MalformedToolCall) -> ToolResult:
        start = time.monotonic()
        name, content, error = await self._call(call)
        if error is None and len(content) > self.max_result_chars:
            cut = len(content) - self.max_result_chars
            content = f"{content[: self.max_result_chars]}... [{cut} more characters cut]"
        return ToolResult(name, content if error is None else f"error: {content}", error, time.monotonic() - start)

    async def _call(self, call: ToolCall | MalformedToolCall) -> tuple[str, str, str | None]:
        """(tool name, output or what went wrong, error kind or None)."""
        if isinstance(call, MalformedToolCall):
            return "", f"malformed tool call: {call.reason}", MALFORMED
        tool = self.tools.get(call.name)
        if tool is None:
            return call.name, f"unknown tool {call.name!r}; the tools are {sorted(self.tools)}", UNKNOWN_TOOL
        if (wrong := tool.check_arguments(call.arguments)) is not None:
            return tool.name, wrong, BAD_ARGUMENTS
        try:
            if inspect.iscoroutinefunction(tool.fn):
                result = await asyncio.wait_for(tool.fn(**call.arguments), self.timeout_s)
            else:
                running = asyncio.get_running_loop().run_in_executor(self._threads, lambda: tool.fn(**call.arguments))
                result = await asyncio.wait_for(running, self.timeout_s)
        except TimeoutError:
            return tool.name, f"{tool.name} did not finish within {self.timeout_s:g} s", TIMEOUT
        except ToolError as e:
            return tool.name, f"{tool.name}: {e}", e.kind
        except Exception as e:  # the tool's own failure is the model's observation, not the run's
            return tool.name, f"{tool.name} raised {type(e).__name__}: {e}", RAISED
        return (tool.name, *_as_text(tool.name, result))

    def close(self) -> None:
        """Stop taking calls; threads held by hung synchronous tools are left to end on their own."""
        self._threads.shutdown(wait=False, cancel_futures=True)


def _as_text(name: str, result: Any) -> tuple[str, str | None]:
    if isinstance(result, str):
        return result, None
    try:
        return json.dumps(result, ensure_ascii=False, allow_nan=False), None
    except (TypeError, ValueError, RecursionError) as e:
        return f"{name} returned {type(result).__name__}, not text or JSON ({e})", BAD_RESULT
