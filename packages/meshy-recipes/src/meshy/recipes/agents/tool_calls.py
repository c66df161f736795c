"""Tool calls parsed from the text of one assistant turn, in the format of the chat template's model.

FORMATS: "qwen3" writes each call as `<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>` (the
format Qwen3's chat template shows in the system prompt); "smollm2" writes a block's calls as one JSON
array, `<tool_call>[{"name": NAME, "arguments": {...}}, ...]</tool_call>`, and `[]` for no call (the
format SmolLM2's function-calling system prompt shows; meshy.recipes.prompts.chat_templates). In both,
`arguments` may also be a JSON string holding the object, as Qwen3's template accepts. A call that
cannot be parsed is not an exception: it is a MalformedToolCall saying what is wrong, which the
environment answers with an error observation, so the trajectory goes on and the policy learns from the
mistake.
"""

import json
from dataclasses import dataclass
from typing import Any

from meshy.dataplane import SchemaError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FORMATS = ("qwen3", "smollm2")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedToolCall:
    text: str  # what the model wrote inside the tags (or after a tag it never closed; smollm2: the call as JSON)
    reason: str


def parse_tool_calls(text: str, format: str = "qwen3") -> list[ToolCall | MalformedToolCall]:
    """Every call of every `<tool_call>` block of `text`, in order; text outside the blocks is not a call."""
    if format not in FORMATS:
        raise SchemaError(f"tool-call format: unknown format {format!r}; expected one of {FORMATS}")
    parse_block = _parse_qwen3_block if format == "qwen3" else _parse_smollm2_block
    calls: list[ToolCall | MalformedToolCall] = []
    rest = text
    while (start := rest.find(OPEN)) != -1:
        rest = rest[start + len(OPEN) :]
        end = rest.find(CLOSE)
        if end == -1:
            calls.append(MalformedToolCall(rest.strip(), f"{OPEN} is not closed by {CLOSE}"))
            break
        calls += parse_block(rest[:end].strip())
        rest = rest[end + len(CLOSE) :]
    return calls


def write_tool_calls(calls: list[ToolCall], format: str = "qwen3") -> str:
    """`calls` as the model writes them in `format` (what parse_tool_calls reads back)."""
    if format not in FORMATS:
        raise SchemaError(f"tool-call format: unknown format {format!r}; expected one of {FORMATS}")
    objects = [json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False) for call in calls]
    if format == "qwen3":
        return "\n".join(f"{OPEN}\n{o}\n{CLOSE}" for o in objects)
    return OPEN + "[\n" + ",\n".join(objects) + "\n]" + CLOSE  # as the smollm2 system prompt's example lays it out


def _parse_qwen3_block(body: str) -> list[ToolCall | MalformedToolCall]:
    payload, error = _json(body)
    return [MalformedToolCall(body, error) if error else _call(payload, body)]


def _parse_smollm2_block(body: str) -> list[ToolCall | MalformedToolCall]:
    payload, error = _json(body)
    if error:
        return [MalformedToolCall(body, error)]
    if not isinstance(payload, list):
        return [MalformedToolCall(body, f"expected a JSON array of calls, got {_kind(payload)}")]
    return [_call(item, json.dumps(item, ensure_ascii=False)) for item in payload]


def _call(payload: Any, text: str) -> ToolCall | MalformedToolCall:
    """The call a parsed JSON value describes; `text`: what the model wrote for it."""
    if not isinstance(payload, dict):
        return MalformedToolCall(text, f'expected a JSON object with "name" and "arguments", got {_kind(payload)}')
    unexpected = sorted(payload.keys() - {"name", "arguments"})
    if unexpected:
        return MalformedToolCall(text, f'unexpected keys {unexpected}: a call has only "name" and "arguments"')
    name, arguments = payload.get("name"), payload.get("arguments", {})
    if not isinstance(name, str) or not name:
        return MalformedToolCall(text, f'"name" must be a non-empty string, got {_kind(name)}')
    if isinstance(arguments, str):  # the arguments object written as a JSON string
        arguments, error = _json(arguments)
        if error:
            return MalformedToolCall(text, f'"arguments" is a string that holds no JSON ({error})')
    if not isinstance(arguments, dict):
        return MalformedToolCall(text, f'"arguments" must be a JSON object, got {_kind(arguments)}')
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
