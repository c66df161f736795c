"""reasoning-gym's procedural tasks (100+ datasets, each with its own verifier) as a Meshy task, any of
them by name:

    [task]
    tokenizer = "meshy.recipes.tasks.hf_tokenizer:tokenizer"
    problems = "meshy.recipes.tasks.reasoning_gym:problems"
    reward = "meshy.recipes.tasks.reasoning_gym:score"
    options = { dataset = "chain_sum", config = { min_terms = 2, max_terms = 2 }, template = "smollm2" }

`config` holds the dataset's own configuration fields (reasoning_gym's `<Name>Config`, without `seed`
and `size`, which Meshy sets). Each problem's ground truth carries the dataset's name and entry, so the
dataset's own `score_answer` scores the response: `score` passes the whole response (stripped), and
`score_tagged` what the response puts inside its last `<answer>...</answer>` (reasoning-gym's own
convention for models that reason first). Most datasets give 1.0 for an exact answer and
len(answer) / len(response) when the answer only appears inside a longer response; `score_exact` keeps
full marks only (a short numeric answer appears by chance inside many wrong responses).

Item i of seed s is reasoning-gym's item i of a dataset seeded with s, so streams of nearby seeds
overlap; a held-out set is kept apart by the problems it holds (meshy.recipes.usercode.held_out), not by its seed.
"""

import functools
import json
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from meshy.dataplane import SchemaError
from meshy.dataplane.fields import check_fields
from meshy.recipes.prompts.chat_templates import TEMPLATES, Message, render
from meshy.recipes.prompts.problem import Problem

VIRTUAL_SIZE = 1 << 40  # reasoning-gym computes item i from (seed, i): the stream never repeats an index
MAX_SCORED_CHARS = 4_096  # a longer response cannot be a short task's answer; scored on its last chars


@dataclass(frozen=True)
class ReasoningGymOptions:
    """dataset: a reasoning-gym dataset name. config: its configuration fields. template: the chat template
    the question is rendered in ("plain": the question text alone). system: a system message (None: the
    template's default). instruction: the user message, with "{question}" where the question goes.
    enable_thinking: the template's thinking switch (qwen3, minicpm5)."""

    dataset: str
    config: dict = field(default_factory=dict)
    template: str = "plain"
    system: str | None = None
    instruction: str = "{question}"
    enable_thinking: bool | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.template not in TEMPLATES:
            raise SchemaError(f"template: unknown chat template {self.template!r}; expected one of {TEMPLATES}")
        if "{question}" not in self.instruction:
            raise SchemaError(f"instruction: expected text containing {{question}}, got {self.instruction!r}")
        for name in ("seed", "size"):
            if name in self.config:
                raise SchemaError(f"config.{name}: set by Meshy (the run's seed; an endless stream); leave it out")

    def prompt(self, question: str) -> str:
        if self.template == "plain":
            return self.instruction.replace("{question}", question)
        messages = [Message("system", self.system)] if self.system is not None else []
        messages.append(Message("user", self.instruction.replace("{question}", question)))
        return render(self.template, messages, enable_thinking=self.enable_thinking)


def problems(seed: int, **options: Any) -> Iterator[Problem]:
    """An endless, seeded stream of the dataset's problems; the options (ReasoningGymOptions' fields) and
    the dataset's config are checked before this returns."""
    known = [f.name for f in fields(ReasoningGymOptions)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise SchemaError(f"reasoning-gym task: unknown option {unknown[0]!r}; expected some of {known}")
    if "dataset" not in options:
        raise SchemaError(f"reasoning-gym task: missing option 'dataset'; expected one of {dataset_names()}")
    opts = ReasoningGymOptions(**options)
    dataset = _dataset(opts.dataset, opts.config, seed)
    return _stream(dataset, opts)


def ask(question: str, **options: Any) -> str:
    """A question of the user's asked as `problems` asks the dataset's (`meshy sample`)."""
    return ReasoningGymOptions(**options).prompt(question)


def _stream(dataset: Any, opts: ReasoningGymOptions) -> Iterator[Problem]:
    index = 0
    while True:
        entry = dataset[index]
        index += 1
        truth = {"dataset": opts.dataset, "answer": entry["answer"], "metadata": entry.get("metadata", {})}
        yield Problem(opts.prompt(entry["question"]), json.dumps(truth))


def score(response: str, ground_truth: str) -> float:
    """The dataset's own score of the whole response (stripped)."""
    return _score(response.strip(), ground_truth)


def score_exact(response: str, ground_truth: str) -> float:
    """1.0 when the dataset's own verifier gives the whole response (stripped) full marks, else 0.0: no
    partial credit for an answer found inside a longer response, which a policy can earn by writing digits
    that happen to be the answer's (restating the question's numbers, say)."""
    return float(_score(response.strip(), ground_truth) >= 1.0)


def score_tagged(response: str, ground_truth: str) -> float:
    """The dataset's own score of the last `<answer>...</answer>` in the response (0.0 without one)."""
    answer = _library().utils.extract_answer(response[-MAX_SCORED_CHARS:])
    return 0.0 if answer is None else _score(answer, ground_truth)


def right_answer(ground_truth: str) -> str:
    """The dataset's answer in a ground truth: a response `score` and `score_exact` give full marks."""
    return str(_truth(ground_truth)["answer"])


def tagged_answer(ground_truth: str) -> str:
    """The dataset's answer inside `<answer>` tags: a response `score_tagged` gives full marks."""
    return f"<answer>{right_answer(ground_truth)}</answer>"


# The ground truth is JSON, not a response: what each reward pays full marks for (meshy.recipes.usercode.task_trial).
score.perfect_response = score_exact.perfect_response = right_answer
score_tagged.perfect_response = tagged_answer


def _score(answer: str, ground_truth: str) -> float:
    truth = _truth(ground_truth)
    entry = {"answer": truth["answer"], "metadata": truth["metadata"]}
    return float(_scorer(truth["dataset"])(answer[-MAX_SCORED_CHARS:], entry))


def _truth(ground_truth: str) -> dict:
    try:
        truth = json.loads(ground_truth)
        if not isinstance(truth, dict) or not {"dataset", "answer", "metadata"} <= set(truth):
            raise ValueError
    except ValueError:
        raise SchemaError(
            "reasoning-gym reward: the ground truth is not one that meshy.recipes.tasks.reasoning_gym:problems wrote "
            f"(expected JSON with dataset, answer and metadata), got {ground_truth[:80]!r}; task.problems and "
            "task.reward must both be reasoning-gym's"
        ) from None
    return truth


@functools.cache
def _library() -> types.ModuleType:
    """reasoning_gym, imported on first use (it imports every dataset: about a second); a dependency of
    one of its datasets warns of its own syntax the first time it is compiled, which users need not see."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        import reasoning_gym
        import reasoning_gym.utils

    return reasoning_gym


@functools.cache
def _scorer(name: str) -> Callable[[str, dict], float]:
    return _library().get_score_answer_fn(name)


def dataset_names() -> list[str]:
    return sorted(_library().factory.DATASETS)


def _dataset(name: str, config: dict, seed: int) -> Any:
    library = _library()
    datasets = library.factory.DATASETS
    if name not in datasets:
        raise SchemaError(f"dataset: unknown reasoning-gym dataset {name!r}; expected one of {dataset_names()}")
    config_fields = {f.name for f in fields(datasets[name][1])} - {"seed", "size"}
    unknown = sorted(set(config) - config_fields)
    if unknown:
        raise SchemaError(
            f"config: {name} has no field {unknown[0]!r}; expected some of {sorted(config_fields)} "
            f"(reasoning_gym's {datasets[name][1].__name__})"
        )
    try:
        return library.create_dataset(name, seed=seed, size=VIRTUAL_SIZE, **config)
    except (AssertionError, TypeError, ValueError) as e:
        raise SchemaError(f"config: reasoning-gym refused {name}'s config {config}: {e or type(e).__name__}") from None
