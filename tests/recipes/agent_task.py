"""A multi-turn task for end-to-end runs of the agent machinery with a tiny model from scratch, and a
custom role that audits every finished trajectory before training takes it.

The vocabulary is small (the chat markers and a few characters), so a model from scratch ends its turns
with `<|im_end|>` often: trajectories take several turns, and some run into the limits. The environment
answers every turn with the tool result "ok" until a turn of an even number of characters, which it
takes as the final answer, rewarded with the number of turns it answered before: a count it keeps as its
state between steps (which may be taken by different processes), so a reward that is not `turns - 1`
means the state was lost on the way.
"""

from collections.abc import Iterator

import torch

from meshy.dataplane import columns as cols
from meshy.recipes.agents.tool_environment import Step
from meshy.recipes.agents.trajectory import NO_VERSION
from meshy.recipes.prompts.chat_templates import Message, observation
from meshy.recipes.prompts.problem import Problem
from meshy.recipes.roles.context import RoleContext

MARKERS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")  # <|im_end|>: the model's eos, 2
CHARACTERS = "\n ?<>/_|abcdefghijklmnopqrstuvwxyz0123456789+="
RESULT = "ok"
TEMPLATE = "qwen3"


class SmallTokenizer:
    vocab_size = len(MARKERS) + len(CHARACTERS)
    eos_token_id = 2
    bos_token_id = pad_token_id = 0

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            marker = next((m for m in MARKERS if text.startswith(m, i)), None)
            if marker is not None:
                ids.append(MARKERS.index(marker))
                i += len(marker)
                continue
            ids.append(len(MARKERS) + CHARACTERS.index(text[i] if text[i] in CHARACTERS else "?"))
            i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        vocab = MARKERS + tuple(CHARACTERS)
        return "".join(vocab[i] for i in ids if 0 <= i < len(vocab))


def tokenizer() -> SmallTokenizer:
    return SmallTokenizer()


def problems(seed: int) -> Iterator[Problem]:
    n = seed
    while True:
        n += 1
        yield Problem(f"say {n % 97}", str(n % 97))


class EchoEnvironment:
    def __init__(self, tool_timeout_s: float):
        self.problem, self.answered = None, 0

    def tool_schemas(self) -> list[dict]:
        return []

    def state(self) -> int:
        return self.answered

    def restore(self, state: int) -> None:
        self.answered = state

    async def reset(self, problem: Problem) -> list[Message]:
        self.problem, self.answered = problem, 0
        return [Message("user", problem.prompt)]

    async def step(self, action: str) -> Step:
        text = action.removesuffix("<|im_end|>")
        if len(text) % 2 == 0:
            return Step([], float(self.answered), True)
        self.answered += 1
        return Step([RESULT], 0.0, False)


def environment(tool_timeout_s: float) -> EchoEnvironment:
    return EchoEnvironment(tool_timeout_s)


class TrajectoryAuditor:
    """Checks every finished trajectory against what the environment role promises, and records one
    line per row: the policy's turns end at the engine's end of turn (but the last, which may be cut),
    every observation between two turns is exactly the template's rendering of the tool result, policy
    tokens carry a logprob and a version >= 0, observation tokens 0.0 and NO_VERSION."""

    def __init__(self, ctx: RoleContext, task: str):
        self.ctx, self.task = ctx, task
        self.tokenizer = SmallTokenizer()
        enable_thinking = ctx.recipe.agent.enable_thinking
        self.observed = self.tokenizer.encode(observation(TEMPLATE, [RESULT], enable_thinking=enable_thinking))

    def audit(self, response: list[int], mask: list[bool], logprobs: list[float], versions: list[int]) -> list[str]:
        problems, segments, i = [], [], 0
        while i < len(response):
            j = i
            while j < len(response) and mask[j] == mask[i]:
                j += 1
            segments.append((mask[i], i, j))
            i = j
        if segments and not segments[0][0]:
            problems.append("starts with an observation")
        for k, (policy, start, end) in enumerate(segments):
            last = k == len(segments) - 1
            if policy:
                if not last and response[end - 1] != self.tokenizer.eos_token_id:
                    problems.append(f"turn at {start} does not end with <|im_end|>")
                if any(v < 0 for v in versions[start:end]) or any(p > 0 for p in logprobs[start:end]):
                    problems.append(f"turn at {start}: a policy token without a version or with logprob > 0")
            else:
                if last:
                    problems.append("ends with an observation")
                if response[start:end] != self.observed:
                    problems.append(f"observation at {start} is not the rendered tool result")
                if any(v != NO_VERSION for v in versions[start:end]) or any(p != 0 for p in logprobs[start:end]):
                    problems.append(f"observation at {start} carries a version or a logprob")
        return problems

    def audit_ready_rows(self, timeout: float) -> int:
        reads = [cols.RESPONSE_IDS, cols.POLICY_MASK, cols.ROLLOUT_LOGPROBS, cols.TOKEN_VERSIONS, cols.FINISH_REASON]
        ppo = self.ctx.recipe.algorithm.kind == "ppo"
        reads += [cols.ADVANTAGE, cols.RETURNS] * ppo
        batch = self.ctx.client.lease(self.ctx.table, self.task, reads, count=64, min_count=1, timeout=timeout)
        if batch is None:
            return 0
        for i, row in enumerate(batch.row_ids):
            c = batch.columns
            response, mask = c[cols.RESPONSE_IDS][i].tolist(), c[cols.POLICY_MASK][i].tolist()
            logprobs, versions = c[cols.ROLLOUT_LOGPROBS][i].tolist(), c[cols.TOKEN_VERSIONS][i].tolist()
            problems = self.audit(response, mask, logprobs, versions)
            if len(mask) != len(response):
                problems.append(f"{len(mask)} mask entries for {len(response)} tokens")
            if ppo:
                problems += self.audit_gae(c[cols.POLICY_MASK][i], c[cols.ADVANTAGE][i], c[cols.RETURNS][i])
            turns = sum(1 for k, m in enumerate(mask) if m and (k == 0 or not mask[k - 1]))
            self.ctx.record("audit", row=row, turns=turns, finish_reason=c[cols.FINISH_REASON][i], problems=problems)
        self.ctx.client.ack(batch)
        return len(batch)

    @staticmethod
    def audit_gae(mask: torch.Tensor, advantage: torch.Tensor, returns: torch.Tensor) -> list[str]:
        """GAE steps over the policy's tokens: an observation token has no advantage and no return, and
        (gamma 1, the reward on the last policy token) every policy token's return is the reward."""
        problems = []
        if returns[~mask].any() or (len(advantage) and advantage[~mask].any()):
            problems.append("an observation token has an advantage or a return")
        if mask.any() and not returns[mask].eq(returns[mask][-1]).all():
            problems.append("the policy tokens' returns are not all the trajectory's reward")
        return problems

    def run(self) -> None:
        self.ctx.watch_for_stop()
        while not self.ctx.stop.is_set():
            self.audit_ready_rows(timeout=0.5)
        while self.audit_ready_rows(timeout=0.0):
            pass
