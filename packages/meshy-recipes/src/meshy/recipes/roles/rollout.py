"""The rollout role: writes prompts (paced by weights versions), scores responses, computes advantages.

Pacing: after the trainer has published g versions (v0 included), rollout may have written at most
(g - 1 + W) batches, a batch being prompts_per_step groups of group_size rows. W = 1 is on-policy
lock-step, W = k lets rollout run k - 1 versions ahead, W = "none" is bounded only by `FREE_BATCHES`
batches in flight.

In a multi-turn run (task.environment), a row is a problem to play (its text and ground truth): the
environment role renders the prompt, plays the trajectory and writes its reward, so rollout neither
tokenizes nor scores.

Rewards are per row; advantages need whole groups (GRPO: the group's mean, optionally its std). A row
the trainer should skip (dynamic sampling: its group's rewards are all equal) gets an empty advantage.

The task's code runs here (its tokenizer, problem stream and reward): what it raises, and rows the
engine could not generate, stop the run or drop the row as the recipe's on_task_error says
(meshy.recipes.usercode.task_errors). A dropped row's reward is NaN: it is left out of its group's statistics and
gets no advantage.
"""

import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from meshy.dataplane import HOST
from meshy.dataplane import columns as cols
from meshy.dataplane.weights import WEIGHTS_STREAM
from meshy.recipes.roles.context import KEPT_ROWS_STREAM, RecordKind, RoleContext
from meshy.recipes.usercode.held_out import WithoutHeldOut, held_out_problems, response_text
from meshy.recipes.usercode.imports import import_object
from meshy.recipes.usercode.task_errors import TaskError, call_task, checked_reward, engine_error
from meshy.train.advantages import (
    dapo_overlong_penalty,
    drop_uniform_groups,
    gae,
    grpo_advantages,
    push_tied_groups,
    sample_lambdas,
    tail_overlong_bonus,
)

FREE_BATCHES = 8  # how far ahead a fully asynchronous rollout may run
LEASE_ROWS = 256  # rows scored, or given advantages, at once (as many as are ready, up to this)
MAX_UNTOKENIZED_IN_A_ROW = 100  # with on_task_error = "drop": problems skipped in a row before the run stops


class RolloutRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        task = ctx.recipe.task
        self.tokenizer = call_task(
            "task.tokenizer",
            task.tokenizer,
            "when built with task.tokenizer_options",
            lambda: import_object(task.tokenizer, "task.tokenizer")(**task.tokenizer_options),
        )
        self.reward_fn: Callable[[str, str], float] = import_object(task.reward, "task.reward")
        seed = ctx.recipe.seed * 1000 + ctx.slot.index
        self.problems: Iterator = call_task(
            "task.problems",
            task.problems,
            f"when called with seed {seed} and task.options",
            lambda: import_object(task.problems, "task.problems")(seed, **task.options),
        )
        if ctx.recipe.eval is not None:  # never trained on
            self.problems = WithoutHeldOut(self.problems, held_out_problems(ctx.recipe))
        self.drop = ctx.recipe.on_task_error == "drop"
        self.first_batch, self.written_before = self._written_before()
        self.predecessor_wrote = True  # until a batch has no row in the data plane (see _write_batch)
        self.rows_written = self.problems_drawn = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        self.ctx.watch_for_stop()
        workers = [
            threading.Thread(target=self._guarded(f), name=f"meshy-{f.__name__}", daemon=True)
            for f in (self.produce, self.advantages) + (() if self.ctx.recipe.multi_turn else (self.score,))
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if self.failure is not None:
            raise self.failure  # the launcher reports it and stops the run

    def _guarded(self, loop: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                loop()
            except Exception as e:  # one loop failing ends the role: the others stop, run() raises it
                if self.failure is None:
                    self.failure = e
                self.ctx.stop.set()

        return run

    # ---- prompts ------------------------------------------------------------------------------
    def produce(self) -> None:
        ctx, algo = self.ctx, self.ctx.recipe.algorithm
        slot = ctx.slot
        weights = ctx.client.reader(WEIGHTS_STREAM, f"rollout-{slot.index}-pacing", start=1)
        ahead = algo.window if algo.window is not None else FREE_BATCHES
        batch = self._skip_to(self.first_batch)  # batch b is trained into version b + 1
        latest = None
        while not ctx.stop.is_set():
            waiting = latest is None or batch >= latest + ahead  # then block on the next version
            for message in weights.read(max_n=1024, timeout=0.5 if waiting else 0.0):
                latest = message.payload["version"]
            if latest is None or batch >= latest + ahead:
                continue
            if self._write_batch(batch):
                skipped = self.problems.skipped if isinstance(self.problems, WithoutHeldOut) else None
                held_out = {"held_out_skipped": skipped} if skipped is not None else {}
                ctx.record(RecordKind.BATCH, batch=batch, latest_version=latest, rows=self.rows_written, **held_out)
            batch += 1

    def _written_before(self) -> tuple[int, set[int]]:
        """The run's first batch (the version it resumed at; 0 for a fresh run) and the rows a resumed run must
        not write again: kept from its stopped run, or trained into the restored version already
        (meshy.recipes.launch.kept_rows)."""
        reader = self.ctx.client.reader(KEPT_ROWS_STREAM, f"rollout-{self.ctx.slot.index}-kept", start=1)
        try:
            messages = reader.read(max_n=1)  # appended before any role started, if at all
        finally:
            reader.close()
        if not messages:
            return 0, set()
        return messages[0].payload["version"], set(messages[0].payload["rows"])

    def _skip_to(self, version: int) -> int:
        """Continue the prompt sequence at the batch a run restored at `version` trains next."""
        for _ in range(version * (self.ctx.recipe.algorithm.prompts_per_step // self.ctx.slot.count)):
            self._next_problem()
        return version

    def _next_problem(self):
        where = f"drawing problem {self.problems_drawn}"
        problem = call_task("task.problems", self.ctx.recipe.task.problems, where, next, self.problems)
        self.problems_drawn += 1
        return problem

    def _tokenized_problem(self) -> tuple[object, torch.Tensor]:
        """The next problem and its prompt ids; with on_task_error = "drop", problems the tokenizer fails on
        are skipped (recorded), so that a batch still holds prompts_per_step groups."""
        task = self.ctx.recipe.task
        for in_a_row in range(1, MAX_UNTOKENIZED_IN_A_ROW + 1):
            problem = self._next_problem()
            where = f"encoding the prompt of problem {self.problems_drawn - 1}: {problem.prompt!r}"
            try:
                ids = call_task("task.tokenizer", task.tokenizer, where, self.tokenizer.encode, problem.prompt)
                return problem, torch.tensor(ids, dtype=torch.int64, device=HOST)
            except TaskError as e:
                if not self.drop or in_a_row == MAX_UNTOKENIZED_IN_A_ROW:
                    raise
                self.ctx.record(RecordKind.TASK_ERRORS, rows=[], errors={e.summary: 1})
        raise AssertionError("unreachable")

    def _write_batch(self, batch: int) -> int:
        """Writes the batch's rows but those written before (by a stopped run, or the process this one
        replaces); how many it wrote."""
        algo, slot = self.ctx.recipe.algorithm, self.ctx.slot
        per_process = algo.prompts_per_step // slot.count
        multi_turn = self.ctx.recipe.multi_turn
        rows, groups, prompts, truths = [], [], [], []
        for p in range(per_process):
            group = (batch * algo.prompts_per_step) + slot.index * per_process + p
            if multi_turn:  # the environment role renders it
                problem = self._next_problem()
                prompt = problem.prompt
            else:
                problem, prompt = self._tokenized_problem()
            for k in range(algo.group_size):
                rows.append(group * algo.group_size + k)
                groups.append(group)
                prompts.append(prompt)
                truths.append(problem.answer)
        prompt_column = cols.PROBLEM if multi_turn else cols.PROMPT_IDS
        written = self.written_before  # a resumed run's rows kept on disk, or trained before its checkpoint
        if self.predecessor_wrote:  # a process started again in place: what the one it replaces wrote
            found = self.ctx.client.written(self.ctx.table, rows)
            self.predecessor_wrote = bool(found)  # batches are written in order: none after the first it lacks
            written = written | set(found)
        if written:
            new = [i for i, r in enumerate(rows) if r not in written]
            if not new:
                return 0
            rows, groups = [rows[i] for i in new], [groups[i] for i in new]
            prompts, truths = [prompts[i] for i in new], [truths[i] for i in new]
        self.ctx.client.put(self.ctx.table, rows, {prompt_column: prompts, cols.GROUND_TRUTH: truths}, group_ids=groups)
        self.rows_written += len(rows)
        return len(rows)

    # ---- rewards ------------------------------------------------------------------------------
    def score(self) -> None:
        client, table = self.ctx.client, self.ctx.table
        task = cols.REWARD_TASK
        while not self.ctx.stop.is_set():
            batch = client.lease(table, task.name, list(task.reads), count=LEASE_ROWS, min_count=1, timeout=0.5)
            if batch is None:
                continue
            c = batch.columns
            rewards, dropped, errors = [], [], Counter()
            for row, response, truth, error in zip(
                batch.row_ids, c[cols.RESPONSE_IDS], c[cols.GROUND_TRUTH], c[cols.ERROR], strict=True
            ):
                try:
                    if error:
                        raise engine_error(row, error, truth)
                    rewards.append(self._reward(row, response.tolist(), truth))
                except TaskError as e:
                    if not self.drop:
                        raise
                    rewards.append(math.nan)
                    dropped.append(row)
                    errors[e.summary] += 1
            if dropped:
                self.ctx.record(RecordKind.TASK_ERRORS, rows=dropped, errors=dict(errors))
            client.add_columns(table, batch.row_ids, {cols.REWARD: torch.tensor(rewards, device=HOST)}, ack=batch)

    def _reward(self, row: int, response: list[int], truth: str) -> float:
        task = self.ctx.recipe.task
        decoding = f"decoding row {row}"
        text = call_task("task.tokenizer", task.tokenizer, decoding, response_text, self.tokenizer, response)
        where = f"on row {row} (response {text!r}, ground truth {truth!r})"
        reward = call_task("task.reward", task.reward, where, self.reward_fn, text, truth)
        return checked_reward(reward, task.reward, where)

    # ---- advantages ---------------------------------------------------------------------------
    def advantages(self) -> None:
        if self.ctx.recipe.algorithm.kind == "ppo":
            return self.critic_advantages()
        client, table, algo = self.ctx.client, self.ctx.table, self.ctx.recipe.algorithm
        while not self.ctx.stop.is_set():
            batch = self._lease_groups()
            if batch is None:
                continue
            responses = batch.columns[cols.RESPONSE_IDS]
            rewards = batch.columns[cols.REWARD] + self._overlong_penalty(responses)
            rewards = rewards.view(-1, algo.group_size)
            advantage, stuck = push_tied_groups(
                grpo_advantages(rewards, scale_by_std=algo.scale_by_std), rewards, algo.tied_group_penalty
            )
            advantage = advantage.view(-1)
            trained = self._trained_rows(rewards)
            per_token = [
                torch.full((len(r) if keep else 0,), float(a), device=HOST)
                for r, a, keep in zip(responses, advantage, trained, strict=True)
            ]
            client.add_columns(table, batch.row_ids, {cols.ADVANTAGE: per_token}, ack=batch)
            groups = len(batch) // algo.group_size
            self.ctx.record(
                RecordKind.ADVANTAGE, groups=groups, reward_mean=float(rewards.nanmean()), tied_below_best=stuck
            )

    def critic_advantages(self) -> None:
        """GAE over the critic's values, outcome reward on the last token, gamma 1, lambda_i = k^(1/L_i);
        returns are the lambda = 1 targets the critic trains on. A multi-turn row steps over its policy's
        tokens only: the reward goes on the last of them, L_i counts them, observations take no step.
        A dropped row (NaN reward) gets no advantage, and its own values as returns: nothing to learn."""
        client, table, algo = self.ctx.client, self.ctx.table, self.ctx.recipe.algorithm
        multi_turn = self.ctx.recipe.multi_turn
        while not self.ctx.stop.is_set():
            batch = self._lease_groups()
            if batch is None:
                continue
            responses, values = batch.columns[cols.RESPONSE_IDS], batch.columns[cols.VALUES]
            lengths = torch.tensor([len(r) for r in responses], device=HOST)
            width = max(1, int(lengths.max()))
            mask = torch.arange(width, device=HOST)[None, :] < lengths[:, None]
            token_rewards, padded_values = (torch.zeros(len(responses), width, device=HOST) for _ in range(2))
            for i, (n, value) in enumerate(zip(lengths.tolist(), values, strict=True)):
                if multi_turn:
                    mask[i, :n] &= batch.columns[cols.POLICY_MASK][i].to(HOST)
                policy = mask[i].nonzero()
                if len(policy):
                    token_rewards[i, policy[-1]] = batch.columns[cols.REWARD][i].nan_to_num()
                    padded_values[i, :n] = value
            steps = mask.sum(dim=1)
            advantage, returns = gae(
                token_rewards, padded_values, mask.float(), 1.0, sample_lambdas(steps.clamp(min=1), algo.gae_k)
            )
            if algo.overlong_buffer:
                advantage = tail_overlong_bonus(advantage, mask.float(), self._overlong_penalty(responses))
            trained = self._trained_rows(batch.columns[cols.REWARD].view(-1, algo.group_size))
            n = lengths.tolist()
            for i in (~batch.columns[cols.REWARD].isfinite()).nonzero().view(-1).tolist():
                returns[i, : n[i]] = values[i]
            client.add_columns(
                table,
                batch.row_ids,
                {  # the critic learns from every row; the policy skips those dynamic sampling drops
                    cols.ADVANTAGE: [advantage[i, : n[i] if trained[i] else 0] for i in range(len(n))],
                    cols.RETURNS: [returns[i, : n[i]] for i in range(len(n))],
                },
                ack=batch,
            )

    def _lease_groups(self):
        """Whole groups ready for the advantage step (None after a short wait)."""
        critic = self.ctx.recipe.algorithm.kind == "ppo"
        task = cols.advantage_with(values=critic, policy_mask=critic and self.ctx.recipe.multi_turn)
        return self.ctx.client.lease(
            self.ctx.table, task.name, list(task.reads), count=LEASE_ROWS, min_count=1, whole_groups=True, timeout=0.5
        )

    def _overlong_penalty(self, responses: list[torch.Tensor]) -> torch.Tensor:
        algo = self.ctx.recipe.algorithm
        if not algo.overlong_buffer:
            return torch.zeros(len(responses), device=HOST)
        lengths = torch.tensor([len(r) for r in responses], device=HOST)
        max_length = self.ctx.recipe.sampling.max_new_tokens
        return dapo_overlong_penalty(lengths, max_length, algo.overlong_buffer, algo.overlong_factor)

    def _trained_rows(self, rewards: torch.Tensor) -> list[bool]:
        """Per row: whether the trainer should learn from it (not a row dropped for a task error, whose reward
        is NaN; dynamic sampling skips uniform groups)."""
        scored = rewards.isfinite().view(-1)
        if not self.ctx.recipe.algorithm.dynamic_sampling:
            return scored.tolist()
        keep, _ = drop_uniform_groups(rewards)
        return (keep.repeat_interleave(rewards.shape[1]) & scored).tolist()
