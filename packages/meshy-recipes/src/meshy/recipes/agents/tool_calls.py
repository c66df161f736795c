"""Tool calls in Qwen3's format, parsed from the text of one assistant turn.

The model writes each call as `<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>` (the format
Qwen3's chat template shows it in the system prompt; `arguments` may also be a JSON string holding the
object, as the template accepts). A call that cannot be parsed is not an exception: it is a
MalformedToolCall saying what is wrong, which the environment answers with an error observation, so the
trajectory goes on and the policy learns from the mistake.
"""

import json
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedToolCall:
    text: str  # what the model wrote inside the tags (or after a tag it never closed)
    reason: str


def parse_tool_calls(text: str) -> list[ToolCall | MalformedToolCall]:
    """Every `<tool_call>` block of `text`, in order; text outside the blocks is not a call."""
    calls: list[ToolCall | MalformedToolCall] = []
    rest = text
    while (start := rest.find(OPEN)) != -1:
        rest = rest[start + len(OPEN) :]
        end = rest.find(CLOSE)
        if end == -1:
            calls.append(MalformedToolCall(rest.strip(), f"{OPEN} is not closed by {CLOSE}"))
            break
        calls.append(_parse_call(rest[:end].strip()))
        rest = rest[end + len(CLOSE) :]
    return calls


def _parse_call(body: str) -> ToolCall | MalformedToolCall:
    payload, error = _json(body)
    if error:
        return MalformedToolCall(body, error)
    if not isinstance(payload, dict):
        return MalformedToolCall(body, f'expected a JSON object with "name" and "arguments", got {_kind(payload)}')
    unexpected = sorted(payload.keys() - {"name", "arguments"})
    if unexpected:
        return MalformedToolCall(body, f'unexpected keys {unexpected}: a call has only "name" and "arguments"')
    name, arguments = payload.get("name"), payload.get("arguments", {})
    if not isinstance(name, str) or not name:
        return MalformedToolCall(body, f'"name" must be a non-empty string, got {_kind(name)}')
    if isinstance(arguments, str):  # the arguments object written as a JSON string
        arguments, error = _json(arguments)
        if error:
            return MalformedToolCall(body, f'"arguments" is a string that holds no JSON ({error})')
    if not isinstance(arguments, dict):
        return MalformedToolCall(body, f'"arguments" must be a JSON object, got {_kind(arguments)}')
    return ToolCall(name, arguments)


def _json(text: str) -> tuple[Any, str | None]:
    """(the JSON value `text` holds, None), or (None, why it holds none)."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"not JSON: {e.msg} at character {e.pos}"
    except RecursionError:
        return None, "not JSON this parser accepts: nested too deeply"


def _kind(value: Any) -> str:
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")
