"""A task's own code failing inside a run: task.tokenizer, task.problems, task.reward or task.environment
raising, or the engine unable to generate a prompt the task made (a token id outside the model's
vocabulary, a prompt longer than the context).

The recipe's `on_task_error` says what a run does then. "stop" (the default) ends the run within seconds:
the role raises TaskError, whose message names the recipe field, the row and the user's own traceback; the
launcher writes it to logs/TASK_ERROR_FILE, and `meshy run` reports it instead of advising a resume, which
would only fail the same way. "drop" keeps going: the row is dropped (its reward is NaN, it gets no
advantage and is never trained on) and the error is recorded.
"""

import math
from collections.abc import Callable
from typing import Any, TypeVar

from meshy.recipes.usercode.imports import traceback_from

TASK_ERROR_FILE = "task_error.txt"  # under the run's logs/
T = TypeVar("T")
TASK_ERROR_ADVICE = (
    'fix it and start the run again (resuming would fail the same way), or set on_task_error = "drop" in the '
    "recipe to drop such rows and go on"
)


class TaskError(Exception):
    """The task's code failed: `field` is the recipe field whose code (or value) to fix, `summary` what
    went wrong (the same for every row it goes wrong on: what records count), `where` on which row."""

    def __init__(self, field: str, summary: str, where: str, detail: str = ""):
        super().__init__(f"{summary} {where}" + (f"\n{detail}" if detail else ""))
        self.field, self.summary = field, summary


def call_task(field: str, path: str, where: str, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), the task's code that `field` names (import path `path`); what it raises becomes a
    TaskError naming the field, `where` it failed (the row, the problem) and the user's traceback."""
    try:
        return fn(*args)
    except Exception as e:
        summary = f"{field} ({path!r}) raised {type(e).__name__}: {e}"
        raise TaskError(field, summary, where, traceback_from(e, __file__)) from e


def checked_reward(value: Any, path: str, where: str) -> float:
    """The reward a task returned, as a float; a TaskError unless it is a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TaskError("task.reward", f"task.reward ({path!r}) returned {value!r}; expected a finite float", where)
    return float(value)


def engine_error(row: int, error: str, truth: str) -> TaskError:
    """The engine could not generate a row: its prompt came from the task (task.problems through
    task.tokenizer), or the model's vocabulary or context is too small for it."""
    return TaskError(
        "task.tokenizer",
        f"inference could not generate a prompt: {error}",
        f"(row {row}, ground truth {truth!r})",
        "the prompt comes from task.problems through task.tokenizer; fix them, or the model "
        "(model.overrides, e.g. vocab_size) or sampling.context_length; `meshy check` tries the task against the "
        "model before a run",
    )
