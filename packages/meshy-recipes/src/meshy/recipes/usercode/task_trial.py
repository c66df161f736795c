"""Trying a recipe's task before any process starts (`meshy check`, `meshy run`): the schema says that the
recipe names code; the trial calls that code on a few problems, as the roles will, so that a task that
cannot work is refused with what to change, not run with every row failing.

What is tried (each failure names the recipe field and the fix; the user's traceback when their code raised):
- task.tokenizer, built with tokenizer_options: its eos_token_id is the model's (the engine ends a response at
  the model's EOS, a reward scores it cut at the tokenizer's; a multi-turn turn ends there), and for pretrained
  weights its bos_token_id too, where it has one; it decodes the ids the model can write.
- TRIAL_PROBLEMS problems of task.problems (seeded as rollout's first process seeds them), and of the held-out
  stream when [eval] draws its own, are tokenized as the roles tokenize them (single-turn: the prompt;
  multi-turn: the environment's conversation rendered with agent.template): every id below the model's vocab_size.
- task.reward gives the right answer full marks (>= 1: what held-out evaluation counts as correct) and the empty
  response a finite number. The right answer is the ground truth, unless the reward function says otherwise with
  a `perfect_response(ground_truth) -> str` attribute (dapo_reward: "Answer: 42"); `perfect_response = None`
  marks a reward without a right answer (a stand-in that pays for something else): its full-marks trial is
  skipped, and said so. The right answer is scored as the model would write it: encoded, then cut at EOS.
- a multi-turn environment (task.environment): an empty final turn gets a finite reward and, when it has a
  `perfect_answer(problem) -> str`, that answer as the final turn full marks.

A hub dataset or tokenizer this machine has not downloaded: `meshy run` downloads it (its processes need it);
`meshy check` does not (`downloads=False`), and says what it could not try.
"""

import asyncio
import contextlib
import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any

from meshy.dataplane import SchemaError
from meshy.recipes.agents.trajectory import open_trajectory
from meshy.recipes.recipe import Recipe
from meshy.recipes.usercode.held_out import response_text
from meshy.recipes.usercode.imports import import_object, raised
from meshy.recipes.weights.hub import NotDownloaded, no_downloads
from meshy.recipes.weights.pretrained import SCRATCH

TRIAL_PROBLEMS = 4
PERFECT_RESPONSE = "perfect_response"  # a reward function's attribute: ground truth -> the response it pays 1
PERFECT_ANSWER = "perfect_answer"  # an environment's attribute: problem -> the final answer it pays 1


def try_task(recipe: Recipe, downloads: bool = True) -> list[str]:
    """Try the recipe's task (see the module's doc). Raises a SchemaError with every failure found; returns
    notes on what was not tried, and why. downloads: whether hub files may be downloaded for it."""
    trial = _Trial(recipe, downloads)
    if downloads:
        trial.run()
    else:
        with no_downloads():
            trial.run()
    if len(trial.failures) == 1:
        raise SchemaError(trial.failures[0])
    if trial.failures:
        numbered = "\n".join(f"{i}. {failure}" for i, failure in enumerate(trial.failures, 1))
        raise SchemaError(f"the task failed {len(trial.failures)} trials:\n{numbered}")
    return trial.notes


def eos_mismatch(recipe: Recipe, tokenizer: Any) -> str | None:
    """Why the model's EOS and the tokenizer's disagree (None: they agree). The engine ends a response, or a
    multi-turn turn, at the model's eos_token_id; a reward scores the response cut at the tokenizer's."""
    eos, model_eos = getattr(tokenizer, "eos_token_id", None), recipe.model.arch().eos_token_id
    if eos == model_eos:
        return None
    if not isinstance(eos, int):
        return (
            f"task.tokenizer: eos_token_id {eos!r}; expected the id that ends a response (the model's is {model_eos})"
        )
    fix = f"set model.overrides.eos_token_id = {eos}" if recipe.model.init == SCRATCH else "use the model's tokenizer"
    return (
        f"model.overrides.eos_token_id: the engine ends a response (a turn) at the model's eos_token_id "
        f"({model_eos}), and task.tokenizer's eos_token_id is {eos}: a reward would score responses cut at "
        f"another id than the one they end with; expected them equal: {fix}"
    )


class _Stopped(Exception):
    """A trial that cannot go on; why is in the failures or notes already."""


class _Trial:
    def __init__(self, recipe: Recipe, downloads: bool) -> None:
        self.recipe, self.downloads = recipe, downloads
        self.arch = recipe.model.arch()
        self.failures: list[str] = []
        self.notes: list[str] = []
        self.vocab_refused = False  # one failure says what vocab_size the task needs

    def run(self) -> None:
        task = self.recipe.task
        try:
            factory = self.load(task.tokenizer, "task.tokenizer")
            options = task.tokenizer_options
            tokenizer = self.call("task.tokenizer", f"{task.tokenizer}(**{options})", factory, **options)
        except _Stopped:
            return
        self.try_tokenizer(tokenizer)
        if self.recipe.multi_turn:
            self.guarded(self.try_environment, tokenizer)
            return
        try:
            reward = self.load(task.reward, "task.reward")
        except _Stopped:
            return
        streams = [("task.problems", task.problems, self.recipe.seed * 1000, task.options)]
        spec = self.recipe.eval
        if spec is not None and (spec.problems or spec.options is not None):  # a held-out stream of its own
            options = task.options if spec.options is None else spec.options
            field = "eval.problems" if spec.problems else "eval.options"
            streams.append((field, spec.problems or task.problems, spec.seed, options))
        for field, path, seed, options in streams:
            self.guarded(self.try_single_turn, tokenizer, reward, field, path, seed, options)

    def guarded(self, trial: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(_Stopped):
            trial(*args)

    def load(self, path: str, field: str) -> Any:
        try:
            return import_object(path, field)
        except SchemaError as e:
            self.failures.append(str(e))
            raise _Stopped from None

    def call(self, field: str, what: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """function(*args, **kwargs), user code: what it raises becomes a failure of `field` (or a note, for a
        hub file not downloaded by `meshy check`), and stops this part of the trial."""
        try:
            return function(*args, **kwargs)
        except _Stopped:
            raise
        except NotDownloaded as e:
            if self.downloads:
                self.failures.append(f"{field}: {e}")
            else:
                self.notes.append(f"{field}: not tried here: {e}. `meshy run` downloads it, and tries the task first")
        except SchemaError as e:
            self.failures.append(f"{field}: {what}: {e}")
        except Exception as e:
            self.failures.append(raised(f"{field}: {what}", e, __file__))
        raise _Stopped

    # ---- the tokenizer --------------------------------------------------------------------------
    def try_tokenizer(self, tokenizer: Any) -> None:
        if (why := eos_mismatch(self.recipe, tokenizer)) is not None:
            self.failures.append(why)
        bos = getattr(tokenizer, "bos_token_id", None)
        if self.recipe.model.init != SCRATCH and bos is not None and bos != self.arch.bos_token_id:
            self.failures.append(
                f"task.tokenizer: bos_token_id {bos}, and the pretrained model (model.init = "
                f"{self.recipe.model.init!r}) has bos_token_id {self.arch.bos_token_id}; expected the model's tokenizer"
            )
        last = self.arch.vocab_size - 1
        for ids in ([0], [last]):
            self.guarded(
                self.call,
                "task.tokenizer",
                f"decode({ids}) (the model writes ids 0 to {last}, model vocab_size = {self.arch.vocab_size})",
                tokenizer.decode,
                ids,
            )

    def check_ids(self, tokenizer: Any, encoded: Iterable[tuple[str, list[Any]]]) -> None:
        """Every id of the encoded texts (what, ids) is an int below the model's vocab_size."""
        vocab, worst = self.arch.vocab_size, None
        if self.vocab_refused:
            return
        for what, ids in encoded:
            bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or i < 0]
            if bad:
                self.failures.append(f"task.tokenizer produced {bad[0]!r} for {what}; expected ids >= 0")
                return
            high = max(ids, default=-1)
            if high >= vocab and (worst is None or high > worst[0]):
                worst = (high, what)
        if worst is None:
            return
        high, what = worst
        self.vocab_refused = True
        own = getattr(tokenizer, "vocab_size", None)
        enough = f"vocab_size >= {high + 1}" + (
            f" (task.tokenizer's vocab_size is {own})" if isinstance(own, int) else ""
        )
        if "vocab_size" in self.recipe.model.overrides:
            field, fix = f"model.overrides.vocab_size = {vocab}", f"set {enough}"
        else:
            field = f"model.name = {self.recipe.model.name!r} has vocab_size = {vocab}"
            fix = f"set model.overrides.{enough}" if self.recipe.model.init == SCRATCH else "use the model's tokenizer"
        self.failures.append(f"{field} but task.tokenizer produced id {high} for {what}: {fix}")

    # ---- single-turn --------------------------------------------------------------------------
    def try_single_turn(
        self, tokenizer: Any, reward: Callable, field: str, path: str, seed: int, options: dict
    ) -> None:
        problems = self.draw(field, path, seed, options)
        encoded = []
        for problem in problems:
            if not isinstance(problem.prompt, str):
                self.failures.append(f"{field}: a problem's prompt is {problem.prompt!r}; expected text")
                return
            ids = self.call("task.tokenizer", f"encode({_short(problem.prompt)})", tokenizer.encode, problem.prompt)
            encoded.append((f"problem {_short(problem.prompt)}", list(ids)))
        self.check_ids(tokenizer, encoded)
        self.try_reward(tokenizer, reward, problems[0])

    def draw(self, field: str, path: str, seed: int, options: dict) -> list[Any]:
        """The first TRIAL_PROBLEMS problems of the stream `path`(seed, **options)."""
        factory = self.load(path, "eval.problems" if field == "eval.problems" else "task.problems")
        stream = self.call(field, f"{path}({seed}, **{options})", factory, seed, **options)
        problems = self.call(field, f"the problems of {path}", lambda: list(itertools.islice(stream, TRIAL_PROBLEMS)))
        if not problems:
            self.failures.append(f"{field}: {path}({seed}, **{options}) yielded no problems")
            raise _Stopped
        for problem in problems:
            if not hasattr(problem, "prompt") or not isinstance(getattr(problem, "answer", None), str):
                self.failures.append(
                    f"{field}: {path} yielded {_short(repr(problem))}; expected problems with .prompt and .answer, "
                    "the ground truth as text"
                )
                raise _Stopped
        return problems

    def try_reward(self, tokenizer: Any, reward: Callable, problem: Any) -> None:
        """task.reward gives the right answer to `problem`, as the model would write it, full marks; the
        empty response a finite number."""
        path, truth, eos = self.recipe.task.reward, problem.answer, tokenizer.eos_token_id
        empty = self.call(
            "task.reward",
            f"{path}('', {_short(truth)}) (an empty response)",
            reward,
            response_text(tokenizer, [eos]),
            truth,
        )
        if not _finite(empty):
            self.failures.append(
                f"task.reward: {path} gave {empty!r} to an empty response (ground truth {_short(truth)}); expected "
                "a finite number (a policy writes empty responses too)"
            )
        perfect = getattr(reward, PERFECT_RESPONSE, _itself)
        if perfect is None:
            self.notes.append(
                f"task.reward: full marks not tried: {path} has no right answer ({PERFECT_RESPONSE} = None)"
            )
            return
        right = self.call("task.reward", f"{path}.{PERFECT_RESPONSE}({_short(truth)})", perfect, truth)
        ids = self.call("task.tokenizer", f"encode({_short(right)}) (the right answer)", tokenizer.encode, right)
        self.check_ids(tokenizer, [(f"the right answer {_short(right)}", list(ids))])
        written = self.call(
            "task.tokenizer", f"decode of the right answer {_short(right)}", response_text, tokenizer, [*ids, eos]
        )
        score = self.call("task.reward", f"{path}({_short(written)}, {_short(truth)})", reward, written, truth)
        if not (_finite(score) and float(score) >= 1.0):
            told = "" if perfect is _itself else f" ({path}.{PERFECT_RESPONSE} of the ground truth)"
            self.failures.append(
                f"task.reward: {path} gave {score!r} to the right answer {_short(written)}{told} of problem "
                f"{_short(problem.prompt)} (ground truth {_short(truth)}): the reward does not give the right answer "
                f"full marks (>= 1.0, what held-out accuracy counts); expected a reward that does, or, when the "
                f"ground truth itself is not a response it pays, a {PERFECT_RESPONSE}(ground_truth) -> str attribute "
                "on the reward function that writes the response it pays"
            )

    # ---- multi-turn -----------------------------------------------------------------------------
    def try_environment(self, tokenizer: Any) -> None:
        task, agent = self.recipe.task, self.recipe.agent
        problems = self.draw("task.problems", task.problems, self.recipe.seed * 1000, task.options)
        factory = self.load(task.environment, "task.environment")
        options = {"tool_timeout_s": agent.tool_timeout_s, **task.environment_options}
        what = f"{task.environment}(**{options})"

        def new() -> Any:
            return self.call("task.environment", what, factory, **options)

        async def render(problem: Any) -> list[int]:
            trajectory = await open_trajectory(new(), problem, tokenizer, agent.template, agent.enable_thinking)
            return trajectory.prompt_ids

        encoded = []
        for problem in problems:
            ids = self.call(
                "task.environment",
                f"the conversation of problem {_short(str(problem.prompt))}",
                asyncio.run,
                render(problem),
            )
            encoded.append((f"the conversation of problem {_short(str(problem.prompt))}", ids))
        self.check_ids(tokenizer, encoded)
        end_of_turn = self.call(
            "task.tokenizer", f"decode([{tokenizer.eos_token_id}])", tokenizer.decode, [tokenizer.eos_token_id]
        )
        problem = problems[0]
        step = self.call(
            "task.environment", "an empty final turn", asyncio.run, _final_turn(new(), problem, end_of_turn)
        )
        if not _finite(step.reward):
            self.failures.append(
                f"task.environment: {task.environment} gave {step.reward!r} to an empty final turn (problem "
                f"{_short(str(problem.prompt))}); expected a finite number"
            )
        env = new()
        perfect = getattr(env, PERFECT_ANSWER, None)
        if not callable(perfect):
            self.notes.append(
                f"task.environment: full marks not tried: its environments have no {PERFECT_ANSWER}(problem)"
            )
            return
        answer = self.call("task.environment", f"{PERFECT_ANSWER}({_short(str(problem.prompt))})", perfect, problem)
        turn = answer + end_of_turn
        step = self.call(
            "task.environment", f"the final turn {_short(turn)}", asyncio.run, _final_turn(env, problem, turn)
        )
        if not (step.done and _finite(step.reward) and step.reward >= 1.0):
            self.failures.append(
                f"task.environment: {task.environment} gave {step.reward!r} (done: {step.done}) to the right final "
                f"answer {_short(turn)} of problem {_short(str(problem.prompt))} (ground truth "
                f"{_short(problem.answer)}): it does not give the right answer full marks (>= 1.0); expected an "
                "environment that does"
            )


async def _final_turn(env: Any, problem: Any, turn: str) -> Any:
    """The step of `env`, reset to `problem`, on the policy turn `turn`."""
    await env.reset(problem)
    return await env.step(turn)


def _itself(ground_truth: str) -> str:
    return ground_truth


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
