"""A trajectory in flight as a row of the data plane's `turns` table, and a finished one as the columns of
its rollout row (meshy.dataplane.columns describes both tables).

A turn row is the whole trajectory so far plus the turn to generate: prompt_ids holds the prompt and
every token after it (what the engine continues from), policy_mask, history_logprobs and
history_versions the per-token record of the tokens after the prompt, max_new_tokens the trajectory's
budget left, and the `trajectory` JSON the rest (the problem, the counts, the wall-clock start, the
environment's state). Once the
inference role has added the turn's columns, `read_turn` gives the trajectory back, with the turn.
Turn k of the trajectory in rollout row r is row `turn_row_id(r, k)`.
"""

import json
from collections import Counter
from typing import Any

import torch

from meshy.dataplane import HOST
from meshy.dataplane import columns as cols
from meshy.infer.engine import Generation
from meshy.recipes.agents.trajectory import MAX_TOKENS, TURN_LIMIT, AgentLimits, Trajectory
from meshy.recipes.prompts.problem import Problem


def turn_row_id(trajectory_row: int, turn: int) -> int:
    """The turns-table row of turn `turn` (0-based) of the trajectory in rollout row `trajectory_row`."""
    return trajectory_row * TURN_LIMIT + turn


def turn_columns(
    trajectories: list[tuple[Trajectory, int, Problem]], limits: AgentLimits
) -> tuple[list[int], dict[str, Any]]:
    """The rows, and their columns, that ask for the next turn of each (trajectory, its rollout row, its
    problem)."""
    states = [
        {
            "row": row,
            "problem": problem.prompt,
            "answer": problem.answer,
            "prompt_length": len(t.prompt_ids),
            "reward": t.reward,
            "turns": t.turns,
            "tool_calls": dict(t.tool_calls),
            "tool_errors": dict(t.tool_errors),
            "tool_seconds": t.tool_seconds,
            "started": t.started,
            "environment_state": t.environment_state,
        }
        for t, row, problem in trajectories
    ]
    ts = [t for t, _, _ in trajectories]
    columns = {
        cols.TRAJECTORY: [json.dumps(state) for state in states],
        cols.PROMPT_IDS: [torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.int64, device=HOST) for t in ts],
        cols.MAX_NEW_TOKENS: torch.tensor([t.budget(limits) for t in ts], dtype=torch.int64, device=HOST),
        cols.POLICY_MASK: [torch.tensor(t.policy_mask, dtype=torch.bool, device=HOST) for t in ts],
        cols.HISTORY_LOGPROBS: [torch.tensor(t.logprobs, dtype=torch.float32, device=HOST) for t in ts],
        cols.HISTORY_VERSIONS: [torch.tensor(t.token_versions, dtype=torch.int64, device=HOST) for t in ts],
    }
    return [turn_row_id(row, t.turns) for t, row, _ in trajectories], columns


def read_turn(columns: dict[str, Any], i: int) -> tuple[int, Problem, Trajectory, Generation, str]:
    """Row i of a leased batch of observed turns: (trajectory row, problem, the trajectory so far, the
    generated turn, the engine's error for it)."""
    state = json.loads(columns[cols.TRAJECTORY][i])
    ids = columns[cols.PROMPT_IDS][i].tolist()
    n = state["prompt_length"]
    trajectory = Trajectory(
        prompt_ids=ids[:n],
        response_ids=ids[n:],
        policy_mask=columns[cols.POLICY_MASK][i].tolist(),
        logprobs=columns[cols.HISTORY_LOGPROBS][i].tolist(),
        token_versions=columns[cols.HISTORY_VERSIONS][i].tolist(),
        reward=state["reward"],
        turns=state["turns"],
        tool_calls=Counter(state["tool_calls"]),
        tool_errors=Counter(state["tool_errors"]),
        tool_seconds=state["tool_seconds"],
        started=state["started"],
        environment_state=state["environment_state"],
    )
    turn = Generation(
        request_id="",
        output_ids=columns[cols.RESPONSE_IDS][i].tolist(),
        logprobs=columns[cols.ROLLOUT_LOGPROBS][i].tolist(),
        token_versions=columns[cols.TOKEN_VERSIONS][i].tolist(),
        finish_reason=columns[cols.FINISH_REASON][i],
    )
    return state["row"], Problem(state["problem"], state["answer"]), trajectory, turn, columns[cols.ERROR][i]


def trajectory_columns(trajectories: list[Trajectory]) -> dict[str, Any]:
    """Finished trajectories as the columns the environment role adds to their rollout rows."""
    ts = trajectories
    return {
        cols.RESPONSE_IDS: [torch.tensor(t.response_ids, dtype=torch.int64, device=HOST) for t in ts],
        cols.ROLLOUT_LOGPROBS: [torch.tensor(t.logprobs, dtype=torch.float32, device=HOST) for t in ts],
        cols.TOKEN_VERSIONS: [torch.tensor(t.token_versions, dtype=torch.int64, device=HOST) for t in ts],
        cols.POLICY_MASK: [torch.tensor(t.policy_mask, dtype=torch.bool, device=HOST) for t in ts],
        cols.FINISH_REASON: [t.finish_reason for t in ts],
        cols.TRUNCATED: torch.tensor([t.finish_reason == MAX_TOKENS for t in ts], dtype=torch.bool, device=HOST),
        cols.ERROR: [t.error for t in ts],
        cols.REWARD: torch.tensor([t.reward for t in ts], dtype=torch.float32, device=HOST),
    }
