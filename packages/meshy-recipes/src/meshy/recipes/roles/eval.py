"""The eval role: the held-out problems ([eval]) answered by each version training keeps for it
(meshy.recipes.usercode.held_out), on the engine the recipe names, while training goes on; colocated, only in
its turns on the ring's devices. It evaluates the newest version announced: one that a newer one
overtook before its turn came is skipped (recorded), the last one never is. Its figures go back to
training on the EVAL_RESULTS stream; its records keep a few answers of each version."""

import asyncio
import dataclasses
import functools
import shutil
import time
from collections import Counter
from pathlib import Path

from meshy.dataplane import SchemaError
from meshy.dataplane.weights import Published
from meshy.infer.engine import Engine, SamplingParams
from meshy.recipes.roles.colocation import DeviceTurns, engine_turns
from meshy.recipes.roles.context import RecordKind, RoleContext
from meshy.recipes.roles.engines import build_engine
from meshy.recipes.usercode.held_out import EVAL_RESULTS, EVAL_WEIGHTS, figures, held_out_problems, response_text
from meshy.recipes.usercode.imports import import_object
from meshy.recipes.usercode.task_errors import TaskError, call_task, checked_reward

EXAMPLES = 3  # answers of each evaluated version kept in the role's records


class EvalRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        recipe = ctx.recipe
        if ctx.slot.count > 1:
            raise SchemaError(f"roles.eval.processes: one process evaluates the held-out set, got {ctx.slot.count}")
        task = recipe.task
        self.tokenizer = call_task(
            "task.tokenizer",
            task.tokenizer,
            "when built with task.tokenizer_options",
            lambda: import_object(task.tokenizer, "task.tokenizer")(**task.tokenizer_options),
        )
        self.reward_fn = import_object(task.reward, "task.reward")
        self.problems = held_out_problems(recipe)
        encode = self.tokenizer.encode
        self.prompts = [
            call_task("task.tokenizer", task.tokenizer, f"encoding held-out prompt {p.prompt!r}", encode, p.prompt)
            for p in self.problems
        ]
        self.budget = recipe.eval_max_new_tokens
        longest = max(len(p) for p in self.prompts)
        if longest + self.budget > recipe.sampling.context_length:
            raise SchemaError(
                f"eval.max_new_tokens: a held-out prompt of {longest} tokens and {self.budget} new tokens pass "
                f"sampling.context_length ({recipe.sampling.context_length}); expected fewer new tokens"
            )

    def run(self) -> None:
        self.ctx.watch_for_stop()
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        ctx = self.ctx
        reader = ctx.client.reader(EVAL_WEIGHTS, f"eval-{ctx.slot.index}", start=1)
        engine: Engine | None = None
        turns: DeviceTurns | None = None
        try:
            while not ctx.stop.is_set():
                messages = await asyncio.to_thread(reader.read, 1024, 0.5)
                if not messages:
                    continue
                announced = [Published.from_message(m.payload) for m in messages]
                for overtaken in announced[:-1]:
                    ctx.record(RecordKind.EVAL_SKIPPED, version=overtaken.version)
                    _discard(overtaken)
                published = announced[-1]
                if engine is None:
                    engine, turns = await engine_turns(ctx, functools.partial(self._build, published))
                async with turns.turn_async():
                    if engine.weight_version != published.version:
                        await engine.update_weights(published.version, published)
                    await self._evaluate(engine, published.version)
                _discard(published)
        finally:
            await asyncio.to_thread(reader.close)
            if turns is not None:
                await asyncio.to_thread(turns.close)
            if engine is not None:
                await engine.close()

    def _build(self, published: Published) -> Engine:
        """The engine, from the first version to evaluate, running the whole held-out set's answers at once
        (at most sampling.max_in_flight)."""
        ctx = self.ctx
        slots = min(ctx.recipe.sampling.max_in_flight, len(self.prompts) * ctx.recipe.eval.samples)
        colocated = ctx.slot.ring is not None
        return build_engine(ctx, published, colocate=colocated, version=published.version, max_running=slots)

    async def _evaluate(self, engine: Engine, version: int) -> None:
        spec = self.ctx.recipe.eval
        start = time.monotonic()
        k = spec.samples

        async def answer(i: int, j: int) -> list[int]:
            seed = None if spec.temperature == 0 else (spec.seed * 1_000_003 + i * k + j) % (1 << 63)
            params = SamplingParams(self.budget, temperature=spec.temperature, seed=seed)
            return (await engine.generate(f"eval/{version}/{i}/{j}", self.prompts[i], params)).output_ids

        outputs = await asyncio.gather(*(answer(i, j) for i in range(len(self.prompts)) for j in range(k)))
        texts = [response_text(self.tokenizer, ids) for ids in outputs]
        errors: Counter = Counter()
        rewards = await asyncio.to_thread(lambda: [self._reward(n // k, t, errors) for n, t in enumerate(texts)])
        grouped = [rewards[i * k : (i + 1) * k] for i in range(len(self.prompts))]
        result = figures(version, grouped, time.monotonic() - start)
        self.ctx.client.append(EVAL_RESULTS, dataclasses.asdict(result))
        examples = [
            {"prompt": self.problems[n // k].prompt, "response": texts[n], "reward": rewards[n]}
            for n in range(min(EXAMPLES, len(texts)))
        ]
        self.ctx.record(RecordKind.EVAL, **dataclasses.asdict(result), examples=examples, task_errors=dict(errors))

    def _reward(self, i: int, text: str, errors: Counter) -> float:
        """task.reward of an answer to held-out problem i; with on_task_error = "drop", an answer it raises on
        counts as wrong (0.0), the error counted in `errors`."""
        path, truth = self.ctx.recipe.task.reward, self.problems[i].answer
        where = f"on an answer to held-out problem {i} (answer {text!r}, ground truth {truth!r})"
        try:
            return checked_reward(call_task("task.reward", path, where, self.reward_fn, text, truth), path, where)
        except TaskError as e:
            if self.ctx.recipe.on_task_error == "stop":
                raise
            errors[e.summary] += 1
            return 0.0


def _discard(published: Published) -> None:
    """The eval role owns the kept copies of the versions it is handed (meshy.recipes.usercode.held_out)."""
    shutil.rmtree(Path(published.location), ignore_errors=True)
