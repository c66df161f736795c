"""Chat templates rendered to a string in Python (the task's tokenizer then encodes it, special tokens
included): Qwen3's, MiniCPM5's and a plain one for models without a chat format.

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
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from meshy.dataplane import SchemaError
from meshy.dataplane.fields import check_fields

TEMPLATES = ("qwen3", "minicpm5", "plain")
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
    if template != "qwen3" and (tools or any(m.role == "tool" for m in messages)):
        raise SchemaError(f"template {template!r}: renders no tools or tool messages; only 'qwen3' does")
    if template == "qwen3":
        return render_qwen3(
            messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, tools=tools
        )
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
