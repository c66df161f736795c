"""Tool calls parsed from a policy's text, and tools run so that nothing a call does stops a trajectory."""

import asyncio
import threading
import time

import pytest

from meshy.dataplane import SchemaError
from meshy.recipes.agents.tool_calls import MalformedToolCall, ToolCall, parse_tool_calls
from meshy.recipes.agents.tools import (
    BAD_ARGUMENTS,
    BAD_RESULT,
    MALFORMED,
    RAISED,
    TIMEOUT,
    UNKNOWN_TOOL,
    Tool,
    ToolBox,
)


def test_calls_are_parsed_in_order_with_the_text_around_them_ignored():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>\nand\n<tool_call>'
        '{"name": "now", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call><tool_call>{"name": "ping"}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("add", {"a": 12, "b": 30}),
        ToolCall("now", {"zone": "UTC"}),  # arguments written as a JSON string holding the object
        ToolCall("ping", {}),
    ]
    assert parse_tool_calls("no call here </tool_call>") == []


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"name": "add", "arguments": {"a": 1', "not JSON: Expecting ',' delimiter at character 36"),
        ('["add", {"a": 1}]', 'expected a JSON object with "name" and "arguments", got an array'),
        ('"add"', 'expected a JSON object with "name" and "arguments", got a string'),
        ('{"arguments": {}}', '"name" must be a non-empty string, got null'),
        ('{"name": 7, "arguments": {}}', '"name" must be a non-empty string, got a number'),
        ('{"name": "add", "arguments": [1, 2]}', '"arguments" must be a JSON object, got an array'),
        ('{"name": "add", "arguments": "1, 2"}', '"arguments" is a string that holds no JSON (not JSON: Extra data'),
        ('{"name": "add", "arguments": "[1]"}', '"arguments" must be a JSON object, got an array'),
        ('{"name": "add", "args": {}}', 'unexpected keys [\'args\']: a call has only "name" and "arguments"'),
        ("[" * 100_000 + "]" * 100_000, "not JSON this parser accepts: nested too deeply"),
    ],
)
def test_a_malformed_call_is_reported_with_why_not_raised(body, reason):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(call, MalformedToolCall) and call.text == body and call.reason.startswith(reason)


def test_an_unclosed_call_is_malformed_and_ends_the_parse():
    calls = parse_tool_calls('<tool_call>{"name": "ping", "arguments": {}}</tool_call> <tool_call>{"name": "p')
    unclosed = MalformedToolCall('{"name": "p', "<tool_call> is not closed by </tool_call>")
    assert calls == [ToolCall("ping", {}), unclosed]


def add(a: int, b: int) -> int:
    return a + b


async def slow_echo(text: str) -> str:
    await asyncio.sleep(0.2)
    return text


def run(box: ToolBox, *calls: ToolCall | MalformedToolCall):
    async def all_calls():
        return await asyncio.gather(*(box.call(c) for c in calls))

    return asyncio.run(all_calls())


def test_tools_answer_with_text_or_json_and_describe_themselves_as_the_chat_template_lists_them():
    box = ToolBox([Tool("add", add, "Add two integers.", {"a": "integer", "b": "integer"})], timeout_s=5)
    (result,) = run(box, ToolCall("add", {"a": 12, "b": 30}))
    assert (result.name, result.content, result.error) == ("add", "42", None)
    assert box.schemas() == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        }
    ]


RELEASE = threading.Event()  # set when the test is done, so the hung tool's thread ends with it


def hang() -> str:
    RELEASE.wait(30)  # the box must not wait for it
    return "late"


def boom(x: float) -> str:
    raise ZeroDivisionError("division by zero")


def garbage() -> object:
    return object()


def not_a_number() -> float:
    return float("nan")


def chatty() -> str:
    return "x" * 100


def test_every_kind_of_failure_is_an_error_observation_and_the_other_calls_go_on():
    tools = [
        Tool("add", add, "", {"a": "integer", "b": "integer"}),
        Tool("hang", hang, "", {}),
        Tool("boom", boom, "", {"x": "number"}),
        Tool("garbage", garbage, "", {}),
        Tool("nan", not_a_number, "", {}),
        Tool("chatty", chatty, "", {}),
    ]
    box = ToolBox(tools, timeout_s=0.5, max_result_chars=10)
    start = time.monotonic()
    results = run(
        box,
        MalformedToolCall("{", "not JSON: Expecting property name"),
        ToolCall("sub", {}),
        ToolCall("add", {"a": 1}),
        ToolCall("add", {"a": 1, "b": 2, "c": 3}),
        ToolCall("add", {"a": "1", "b": 2}),
        ToolCall("add", {"a": True, "b": 2}),
        ToolCall("hang", {}),
        ToolCall("boom", {"x": 1.5}),
        ToolCall("garbage", {}),
        ToolCall("nan", {}),
        ToolCall("chatty", {}),
        ToolCall("add", {"a": 2, "b": 2}),
    )
    assert time.monotonic() - start < 5, "a hung tool costs its timeout, not its run time"
    RELEASE.set()
    box.close()
    kinds = [r.error for r in results]
    assert kinds == [MALFORMED, UNKNOWN_TOOL, *[BAD_ARGUMENTS] * 4, TIMEOUT, RAISED, BAD_RESULT, BAD_RESULT, None, None]
    contents = [r.content for r in results]
    assert contents[0] == "error: malformed tool call: not JSON: Expecting property name"
    assert contents[1].startswith("error: unknown tool 'sub'; the tools are ['add', 'boom', 'chatty'")
    assert contents[2] == "error: add takes arguments ['a', 'b']; missing ['b'], unknown []"
    assert contents[3] == "error: add takes arguments ['a', 'b']; missing [], unknown ['c']"
    assert contents[4] == "error: add: argument 'a' must be integer, got \"1\""
    assert contents[5] == "error: add: argument 'a' must be integer, got true"
    assert contents[6] == "error: hang did not finish within 0.5 s"
    assert contents[7] == "error: boom raised ZeroDivisionError: division by zero"
    assert contents[8].startswith("error: garbage returned object, not text or JSON")
    assert contents[9].startswith("error: nan returned float, not text or JSON")
    assert contents[10] == "xxxxxxxxxx... [90 more characters cut]"
    assert contents[11] == "4"


def test_calls_run_concurrently_so_a_slow_tool_costs_its_latency_once():
    box = ToolBox([Tool("echo", slow_echo, "", {"text": "string"})], timeout_s=5)
    start = time.monotonic()
    results = run(box, *[ToolCall("echo", {"text": str(i)}) for i in range(20)])
    elapsed = time.monotonic() - start
    assert [r.content for r in results] == [str(i) for i in range(20)]
    assert elapsed < 2.0, f"20 calls of a 0.2 s tool took {elapsed:.2f} s: they ran one after another"
    assert all(r.seconds >= 0.19 for r in results)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Tool("two words", add, "", {}), "Tool.name: expected a name of letters"),
        (lambda: Tool("add", 3, "", {}), "Tool 'add' fn: expected a callable, got int"),
        (lambda: Tool("add", add, "", {"a": "int"}), "Tool 'add' parameters\\['a'\\]: expected one of \\['string'"),
        (lambda: ToolBox([], timeout_s=0), "ToolBox: expected timeout_s > 0"),
        (
            lambda: ToolBox([Tool("add", add, "", {}), Tool("add", add, "", {})], timeout_s=1),
            "ToolBox: tool names must be unique, got \\['add', 'add'\\]",
        ),
    ],
)
def test_a_bad_tool_definition_is_refused_naming_the_field(make, message):
    with pytest.raises(SchemaError, match=message):
        make()
