"""SmolLM2's chat template with tools, and its tool-call format, checked against strings written by hand from
the format's own text: the function-calling system prompt of HuggingFaceTB/SmolLM2-1.7B-Instruct's model
card, the ChatML turns of SmolLM2-135M-Instruct's template, and the tool response turn of Ollama's smollm2
template; and the calculator task in that format, with worked examples."""

import asyncio
import itertools

import pytest

from meshy.dataplane import SchemaError
from meshy.infer.engine import FINISH_STOP
from meshy.recipes.agents.tool_calls import MalformedToolCall, ToolCall, parse_tool_calls, write_tool_calls
from meshy.recipes.agents.tools import MALFORMED
from meshy.recipes.agents.trajectory import DONE, run_trajectory
from meshy.recipes.prompts.chat_templates import Message, observation, render
from meshy.recipes.tasks import calculator
from tests.recipes.test_agent_trajectory import LIMITS, TOKENIZER, ScriptedPolicy

CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {}}}
TOOLS_SYSTEM = (  # the model card's system prompt, its `{{ tools }}` the json.dumps of the tools' list
    "<|im_start|>system\n"
    "You are an expert in composing functions. You are given a question and a set of possible functions. \n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. \n"
    "If none of the functions can be used, point it out and refuse to answer. \n"
    "If the given question lacks the parameters required by the function, also point it out.\n"
    "\n"
    "You have access to the following tools:\n"
    '<tools>[{"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {}}}]'
    "</tools>\n"
    "\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function call is "
    "needed, please make the tool calls an empty list '[]'.\n"
    "<tool_call>[\n"
    '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\n'
    "... (more tool calls as required)\n"
    "]</tool_call><|im_end|>\n"
)


def test_without_tools_a_conversation_gets_smollm2_s_default_system_turn_unless_it_has_one():
    user = [Message("user", "Hi")]
    assert render("smollm2", user) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render("smollm2", [Message("system", "Be brief."), *user, Message("assistant", "Hello.")]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render("smollm2", [], add_generation_prompt=False) == ""


def test_tools_are_listed_in_the_model_card_s_system_prompt_and_each_result_is_a_user_turn():
    call = '<tool_call>[{"name": "calc", "arguments": {"e": "6*7"}}, {"name": "calc", "arguments": {}}]</tool_call>'
    messages = [
        Message("user", "6*7?"),
        Message("assistant", call),
        Message("tool", "42"),
        Message("tool", "error: no expression"),
        Message("assistant", "42"),
    ]
    assert render("smollm2", messages, tools=[CALC], add_generation_prompt=False) == (
        TOOLS_SYSTEM + "<|im_start|>user\n6*7?<|im_end|>\n"
        "<|im_start|>assistant\n" + call + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nerror: no expression\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n42<|im_end|>\n"
    )
    assert observation("smollm2", ["42", "ok"]) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_what_smollm2_s_template_cannot_write_is_refused_naming_why():
    with pytest.raises(SchemaError, match="enable_thinking: SmolLM2 has no thinking mode; expected None, got False"):
        render("smollm2", [Message("user", "Hi")], enable_thinking=False)
    with pytest.raises(SchemaError, match="with tools, the system turn is SmolLM2's tools prompt"):
        render("smollm2", [Message("system", "Be brief."), Message("user", "Hi")], tools=[CALC])


def test_a_block_holds_a_list_of_calls_and_an_empty_list_is_no_call():
    text = (
        'Sure.\n<tool_call>[\n{"name": "add", "arguments": {"a": 1, "b": 2}},\n'
        '{"name": "now", "arguments": "{\\"zone\\": \\"UTC\\"}"}\n]</tool_call> then <tool_call>[{"name": "ping"}]'
        "</tool_call>"
    )
    assert parse_tool_calls(text, "smollm2") == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("now", {"zone": "UTC"}),
        ToolCall("ping", {}),
    ]
    assert parse_tool_calls("The tools cannot answer this.\n\n<tool_call>[]</tool_call>", "smollm2") == []
    assert parse_tool_calls("no call here", "smollm2") == []


@pytest.mark.parametrize(
    ("body", "text", "reason"),
    [
        ('[{"name": "add"', '[{"name": "add"', "not JSON: Expecting ',' delimiter at character 15"),
        (
            '{"name": "add", "arguments": {}}',
            '{"name": "add", "arguments": {}}',
            "expected a JSON array of calls, got an",
        ),
        ('["add"]', '"add"', 'expected a JSON object with "name" and "arguments", got a string'),
        ('[{"name": ""}]', '{"name": ""}', '"name" must be a non-empty string, got a string'),
        (
            '[{"name": "add", "arguments": [1]}]',
            '{"name": "add", "arguments": [1]}',
            '"arguments" must be a JSON object',
        ),
        ('[{"name": "add", "args": {}}]', '{"name": "add", "args": {}}', "unexpected keys ['args']"),
    ],
)
def test_a_malformed_list_or_call_is_reported_with_why_not_raised(body, text, reason):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", "smollm2")
    assert isinstance(call, MalformedToolCall) and call.text == text and call.reason.startswith(reason)


def test_one_bad_call_of_a_list_leaves_the_others_and_an_unclosed_block_ends_the_parse():
    calls = parse_tool_calls('<tool_call>[{"name": "ping"}, 7]</tool_call><tool_call>[{"name": "p', "smollm2")
    assert calls == [
        ToolCall("ping", {}),
        MalformedToolCall("7", 'expected a JSON object with "name" and "arguments", got a number'),
        MalformedToolCall('[{"name": "p', "<tool_call> is not closed by </tool_call>"),
    ]


def test_calls_are_written_as_each_format_lays_them_out_and_read_back():
    calls = [ToolCall("calc", {"expression": "12*34"}), ToolCall("now", {})]
    assert write_tool_calls(calls, "smollm2") == (
        '<tool_call>[\n{"name": "calc", "arguments": {"expression": "12*34"}},\n{"name": "now", "arguments": {}}\n'
        "]</tool_call>"
    )
    assert write_tool_calls(calls, "qwen3") == (
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    for format in ("qwen3", "smollm2"):
        assert parse_tool_calls(write_tool_calls(calls, format), format) == calls
    with pytest.raises(SchemaError, match=r"tool-call format: unknown format 'hermes'; expected one of \('qwen3'"):
        parse_tool_calls("", "hermes")
    with pytest.raises(SchemaError, match="tool-call format: unknown format 'hermes'"):
        write_tool_calls(calls, "hermes")


def worked(problem) -> list[Message]:
    expression = problem.prompt.removesuffix("=")
    call = f'<tool_call>[\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n]</tool_call>'
    return [
        Message("user", problem.prompt),
        Message("assistant", call),
        Message("tool", problem.answer),
        Message("assistant", problem.answer),
    ]


def test_the_calculator_shows_worked_examples_in_smollm2_s_format_and_runs_the_calls_written_in_it():
    env, problem = calculator.environment(tool_format="smollm2", examples=2), next(calculator.problems(0))
    first, second = itertools.islice(calculator.problems(calculator.EXAMPLES_SEED), 2)
    assert asyncio.run(env.reset(problem)) == [*worked(first), *worked(second), Message("user", problem.prompt)]
    expression = problem.prompt.removesuffix("=")
    call = f'<tool_call>[{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}]</tool_call>'
    right = ScriptedPolicy([(call + "<|im_end|>", 0, FINISH_STOP), (problem.answer + "<|im_end|>", 0, FINISH_STOP)])
    t = asyncio.run(run_trajectory(env, problem, right, TOKENIZER, "smollm2", LIMITS))
    assert (t.finish_reason, t.turns, t.reward) == (DONE, 2, 1.0)
    assert t.tool_calls == {"calculator": 1} and not t.tool_errors
    assert f"<|im_start|>user\n<tool_response>\n{problem.answer}\n</tool_response><|im_end|>\n" in TOKENIZER.decode(
        t.response_ids
    )
    qwen3_call = write_tool_calls([ToolCall("calculator", {"expression": expression})], "qwen3")
    wrong = ScriptedPolicy([(qwen3_call + "<|im_end|>", 0, FINISH_STOP), ("no<|im_end|>", 0, FINISH_STOP)])
    t = asyncio.run(run_trajectory(env, problem, wrong, TOKENIZER, "smollm2", LIMITS))
    assert (t.turns, t.reward, dict(t.tool_errors)) == (2, 0.0, {MALFORMED: 1}), "Qwen3's call is not SmolLM2's"
    assert "error: malformed tool call: expected a JSON array of calls, got an object" in TOKENIZER.decode(
        t.response_ids
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tool_format": "hermes"}, "tool_format: unknown tool-call format 'hermes'; expected one of"),
        ({"examples": 9}, "examples: expected 0..8 worked problems"),
        ({"examples": 1, "tool": False}, r"examples: expected 0..8 worked problems \(0 without the tool\), got 1"),
        ({"partial_credit": True, "tool_format": "smollm2"}, "partial_credit: the call credit reads Qwen3's"),
    ],
)
def test_calculator_options_that_cannot_work_are_refused_naming_the_option(options, message):
    with pytest.raises(SchemaError, match=message):
        calculator.environment(**options)
