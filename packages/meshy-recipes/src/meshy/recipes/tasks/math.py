"""The math task a recipe names: problems(seed, **task.options) yields chat prompts with their answers.

    [task]
    tokenizer = "meshy.recipes.tasks.qwen3_tokenizer:tokenizer"
    problems = "meshy.recipes.tasks.math:problems"
    reward = "meshy.recipes.tasks.math_reward:dapo_reward"
    options = { source = "data/dapo-math-17k.parquet", format = "dapo", template = "qwen3" }

Pair the reward with the instruction: DAPO rows ask for an "Answer:" line (dapo_reward); the default
instruction of every other source asks for \\boxed{} (boxed_reward); math_verify_reward takes either.
"""

import random
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

from meshy.dataplane import SchemaError
from meshy.dataplane.fields import check_fields
from meshy.recipes.prompts.chat_templates import TEMPLATES, Message, render
from meshy.recipes.prompts.problem import Problem
from meshy.recipes.tasks.math_data import FORMATS, Record, generated_records, load_records

GENERATED = "generated"
BOXED_INSTRUCTION = "{question}\n\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class MathOptions:
    """source: "generated" or a data file / hub dataset (then `format` names its layout, one of
    math_data.FORMATS; `domain` filters UltraData rows). template: chat template (qwen3, minicpm5,
    plain). instruction: the user message, with "{question}" where the question goes (default: the
    question alone for DAPO rows, which carry their own instruction, else BOXED_INSTRUCTION).
    system: an optional system message."""

    source: str = GENERATED
    format: str | None = None
    domain: str | None = None
    template: str = "qwen3"
    enable_thinking: bool = False
    instruction: str | None = None
    system: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.source == GENERATED and (self.format is not None or self.domain is not None):
            raise SchemaError('format, domain: the "generated" source takes neither; they describe data files')
        if self.source != GENERATED and self.format not in FORMATS:
            raise SchemaError(f"format: expected one of {FORMATS} for source {self.source!r}, got {self.format!r}")
        if self.template not in TEMPLATES:
            raise SchemaError(f"template: unknown chat template {self.template!r}; expected one of {TEMPLATES}")
        if self.instruction is not None and "{question}" not in self.instruction:
            raise SchemaError(f"instruction: expected text containing {{question}}, got {self.instruction!r}")

    def prompt(self, question: str) -> str:
        default = "{question}" if self.format == "dapo" else BOXED_INSTRUCTION
        messages = [Message("system", self.system)] if self.system is not None else []
        messages.append(Message("user", (self.instruction or default).replace("{question}", question)))
        return render(self.template, messages, enable_thinking=self.enable_thinking)


def ask(question: str, **options: Any) -> str:
    """A question of the user's asked as `problems` asks its own (`meshy sample`)."""
    return MathOptions(**options).prompt(question)


def problems(seed: int, **options: Any) -> Iterator[Problem]:
    """An endless stream: generated problems, or a file's records in a new seeded order every epoch.
    Options are MathOptions' fields; they, and the file, are checked before this returns."""
    known = [f.name for f in fields(MathOptions)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise SchemaError(f"math task: unknown option {unknown[0]!r}; expected some of {known}")
    opts = MathOptions(**options)
    return (Problem(opts.prompt(r.question), r.answer) for r in records(seed, opts.source, opts.format, opts.domain))


def records(
    seed: int, source: str = GENERATED, format: str | None = None, domain: str | None = None
) -> Iterator[Record]:
    """An endless stream of questions and answers: generated ones, or a file's records in a new seeded
    order every epoch (the file is read and checked before this returns)."""
    if source == GENERATED:
        return generated_records(seed)
    return _epochs(load_records(source, format, domain), seed)


def _epochs(records: list[Record], seed: int) -> Iterator[Record]:
    rng, order = random.Random(seed), list(records)
    while True:
        rng.shuffle(order)
        yield from order
