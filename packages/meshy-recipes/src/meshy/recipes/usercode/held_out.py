"""Held-out evaluation ([eval]): the held-out set, how training hands versions to the eval role, and how
the eval role's figures come back to training, which writes them beside its own in metrics.jsonl.

- The held-out set is the first eval.count distinct problems of the eval problem stream; rollout's problem stream
  skips every problem whose prompt is among them (`WithoutHeldOut`), so none is ever trained on.
- Training keeps each evaluated version (0, every eval.every-th, the last) as an HF directory under
  `RUN_DIR/eval/` and announces it on the EVAL_WEIGHTS stream (a KeepingPublisher); the eval role loads
  the newest one announced, evaluates it and deletes it.
- The eval role appends each version's figures to the EVAL_RESULTS stream; the training lead drains it
  every version and, after the last one, waits for the final weights' figures.
"""

import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshy.dataplane import SchemaError
from meshy.recipes.prompts.problem import Problem
from meshy.recipes.recipe import Recipe
from meshy.recipes.usercode.imports import import_object

if TYPE_CHECKING:  # the client imports the data plane's libraries (seconds): meshy check uses response_text only
    from meshy.dataplane import DataPlaneClient

EVAL_WEIGHTS = "eval-weights"  # training -> eval role: the versions to evaluate (Published messages)
EVAL_RESULTS = "eval"  # eval role -> training: each evaluated version's figures
EVAL_DIR = "eval"  # under the run directory: the versions waiting to be evaluated
MAX_DRAWS_PER_PROBLEM = 100  # the held-out set's draws, per distinct problem it needs, before giving up
MAX_SKIPPED_IN_A_ROW = 10_000  # rollout problems in a row that are all held out: the task has no others


def held_out_problems(recipe: Recipe) -> list[Problem]:
    """The held-out set: the first eval.count distinct problems (by prompt) of the eval problem stream."""
    spec = recipe.eval
    assert spec is not None
    path = spec.problems or recipe.task.problems
    options = recipe.task.options if spec.options is None else spec.options
    stream = import_object(path, "eval.problems" if spec.problems else "task.problems")(spec.seed, **options)
    problems: dict[str, Problem] = {}
    draws = MAX_DRAWS_PER_PROBLEM * spec.count
    for problem in itertools.islice(stream, draws):
        problems.setdefault(problem.prompt, problem)
        if len(problems) == spec.count:
            return list(problems.values())
    raise SchemaError(
        f"eval.count: the eval problem stream's first {draws} problems (or all it had) held only "
        f"{len(problems)} distinct prompts, short of {spec.count}; expected a smaller count"
    )


class WithoutHeldOut:
    """A problem stream without the problems whose prompt is held out; `skipped` counts those left out."""

    def __init__(self, problems: Iterator[Problem], held_out: list[Problem]):
        self.problems = problems
        self.prompts = {p.prompt for p in held_out}
        self.skipped = 0

    def __iter__(self) -> "WithoutHeldOut":
        return self

    def __next__(self) -> Problem:
        for in_a_row in itertools.count(1):
            problem = next(self.problems)
            if problem.prompt not in self.prompts:
                return problem
            self.skipped += 1
            if in_a_row >= MAX_SKIPPED_IN_A_ROW:
                raise SchemaError(
                    f"eval.count: the last {in_a_row} training problems were all held out for evaluation; the task "
                    f"has few others ({len(self.prompts)} held out): lower eval.count or widen the task"
                )
        raise AssertionError("unreachable")


def response_text(tokenizer, ids: list[int]) -> str:
    """What a reward function scores: the response decoded up to (not including) the tokenizer's EOS."""
    eos = tokenizer.eos_token_id
    return tokenizer.decode(ids[: ids.index(eos)] if eos in ids else ids)


def evaluated(recipe: Recipe, version: int) -> bool:
    """Whether training keeps `version` for the eval role: 0, every eval.every-th and the last."""
    spec = recipe.eval
    return spec is not None and (version % spec.every == 0 or version == recipe.steps)


@dataclass(frozen=True)
class EvalFigures:
    """One evaluated version: its held-out accuracy (correct answers / answers), pass@k (problems with a
    correct answer among their k, k = samples), mean reward, and how long the evaluation took."""

    version: int
    accuracy: float
    pass_at_k: float
    reward: float
    problems: int
    samples: int
    seconds: float

    def metrics(self) -> dict:
        """Its line of metrics.jsonl."""
        line = {"version": self.version, "time": time.time(), "eval/accuracy": self.accuracy}
        if self.samples > 1:
            line[f"eval/pass@{self.samples}"] = self.pass_at_k
        line.update({"eval/reward": self.reward, "eval/problems": self.problems, "eval/seconds": self.seconds})
        return line


def figures(version: int, rewards: list[list[float]], seconds: float) -> EvalFigures:
    """The figures of `rewards[problem][sample]`; an answer is correct when its reward is >= 1."""
    answers = [r for problem in rewards for r in problem]
    if not answers or any(not math.isfinite(r) for r in answers):
        raise SchemaError(f"eval of version {version}: expected finite rewards for every answer, got {answers[:8]}")
    correct = sum(r >= 1 for r in answers)
    solved = sum(any(r >= 1 for r in problem) for problem in rewards)
    return EvalFigures(
        version,
        correct / len(answers),
        solved / len(rewards),
        sum(answers) / len(answers),
        len(rewards),
        len(rewards[0]),
        seconds,
    )


class EvalResults:
    """The training lead's side of EVAL_RESULTS."""

    def __init__(self, client: "DataPlaneClient"):
        self._reader = client.reader(EVAL_RESULTS, "training-eval", start=1)

    def drain(self) -> list[EvalFigures]:
        """The figures that arrived since the last call (no wait)."""
        return [EvalFigures(**m.payload) for m in self._reader.read(max_n=1024, timeout=0.0)]

    def wait_for(self, version: int, timeout_s: float) -> Iterator[EvalFigures]:
        """Figures as they arrive, until `version`'s or until `timeout_s` has passed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for result in (EvalFigures(**m.payload) for m in self._reader.read(max_n=64, timeout=1.0)):
                yield result
                if result.version == version:
                    return

    def close(self) -> None:
        self._reader.close()
