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
"""

import threading
from collections.abc import Callable, Iterator

import torch

from meshy.dataplane import HOST
from meshy.dataplane import rollout as cols
from meshy.dataplane.weights import WEIGHTS_STREAM
from meshy.recipes.context import RoleContext
from meshy.recipes.evaluation import WithoutHeldOut, held_out_problems, response_text
from meshy.recipes.imports import import_object
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


class RolloutRole:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        recipe = ctx.recipe
        self.tokenizer = import_object(recipe.task.tokenizer, "task.tokenizer")(**recipe.task.tokenizer_options)
        self.reward_fn: Callable[[str, str], float] = import_object(recipe.task.reward, "task.reward")
        seed = recipe.seed * 1000 + ctx.slot.index
        self.problems: Iterator = import_object(recipe.task.problems, "task.problems")(seed, **recipe.task.options)
        if recipe.eval is not None:  # never trained on
            self.problems = WithoutHeldOut(self.problems, held_out_problems(recipe))
        self.rows_written = 0

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

    def _guarded(self, loop: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                loop()
            except Exception:
                self.ctx.stop.set()  # one loop failing ends the role; the launcher reports it
                raise

        return run

    # ---- prompts ------------------------------------------------------------------------------
    def produce(self) -> None:
        ctx, algo = self.ctx, self.ctx.recipe.algorithm
        slot = ctx.slot
        weights = ctx.client.reader(WEIGHTS_STREAM, f"rollout-{slot.index}-pacing", start=1)
        ahead = algo.window if algo.window is not None else FREE_BATCHES
        latest = batch = None  # batch b is trained into version b + 1
        while not ctx.stop.is_set():
            waiting = latest is None or batch >= latest + ahead  # then block on the next version
            for message in weights.read(max_n=1024, timeout=0.5 if waiting else 0.0):
                latest = message.payload["version"]
                if batch is None:  # the first version announced: 0, or the one a resumed run restored
                    batch = self._skip_to(latest)
            if latest is None or batch >= latest + ahead:
                continue
            self._write_batch(batch)
            held_out = {"held_out_skipped": self.problems.skipped} if isinstance(self.problems, WithoutHeldOut) else {}
            ctx.record("batch", batch=batch, latest_version=latest, rows=self.rows_written, **held_out)
            batch += 1

    def _skip_to(self, version: int) -> int:
        """Continue the prompt sequence at the batch a run restored at `version` trains next."""
        for _ in range(version * (self.ctx.recipe.algorithm.prompts_per_step // self.ctx.slot.count)):
            next(self.problems)
        return version

    def _write_batch(self, batch: int) -> None:
        algo, slot = self.ctx.recipe.algorithm, self.ctx.slot
        per_process = algo.prompts_per_step // slot.count
        multi_turn = self.ctx.recipe.multi_turn
        rows, groups, prompts, truths = [], [], [], []
        for p in range(per_process):
            group = (batch * algo.prompts_per_step) + slot.index * per_process + p
            problem = next(self.problems)
            if multi_turn:  # the environment role renders it
                prompt = problem.prompt
            else:
                prompt = torch.tensor(self.tokenizer.encode(problem.prompt), dtype=torch.int64, device=HOST)
            for k in range(algo.group_size):
                rows.append(group * algo.group_size + k)
                groups.append(group)
                prompts.append(prompt)
                truths.append(problem.answer)
        prompt_column = cols.PROBLEM if multi_turn else cols.PROMPT_IDS
        self.ctx.client.put(self.ctx.table, rows, {prompt_column: prompts, cols.GROUND_TRUTH: truths}, group_ids=groups)
        self.rows_written += len(rows)

    # ---- rewards ------------------------------------------------------------------------------
    def score(self) -> None:
        client, table = self.ctx.client, self.ctx.table
        task = cols.REWARD_TASK
        while not self.ctx.stop.is_set():
            batch = client.lease(table, task.name, list(task.reads), count=LEASE_ROWS, min_count=1, timeout=0.5)
            if batch is None:
                continue
            rewards = []
            for response, truth in zip(batch.columns[cols.RESPONSE_IDS], batch.columns[cols.GROUND_TRUTH], strict=True):
                rewards.append(float(self.reward_fn(response_text(self.tokenizer, response.tolist()), truth)))
            client.add_columns(table, batch.row_ids, {cols.REWARD: torch.tensor(rewards, device=HOST)}, ack=batch)

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
            self.ctx.record("advantage", groups=groups, reward_mean=float(rewards.mean()), tied_below_best=stuck)

    def critic_advantages(self) -> None:
        """GAE over the critic's values, outcome reward on the last token, gamma 1, lambda_i = k^(1/L_i);
        returns are the lambda = 1 targets the critic trains on. A multi-turn row steps over its policy's
        tokens only: the reward goes on the last of them, L_i counts them, observations take no step."""
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
                    token_rewards[i, policy[-1]] = batch.columns[cols.REWARD][i]
                    padded_values[i, :n] = value
            steps = mask.sum(dim=1)
            advantage, returns = gae(
                token_rewards, padded_values, mask.float(), 1.0, sample_lambdas(steps.clamp(min=1), algo.gae_k)
            )
            if algo.overlong_buffer:
                advantage = tail_overlong_bonus(advantage, mask.float(), self._overlong_penalty(responses))
            trained = self._trained_rows(batch.columns[cols.REWARD].view(-1, algo.group_size))
            n = lengths.tolist()
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
        """Per row: whether the trainer should learn from it (dynamic sampling skips uniform groups)."""
        if not self.ctx.recipe.algorithm.dynamic_sampling:
            return [True] * rewards.numel()
        keep, _ = drop_uniform_groups(rewards)
        return keep.repeat_interleave(rewards.shape[1]).tolist()
