"""The rollout table: the columns RL roles exchange, defined once for every role.

rollout    writes prompt_ids (and group ids: the n samples of one prompt form a group)
inference  writes response_ids, rollout_logprobs, token_versions, finish_reason, truncated (or error)
reward     writes reward; the advantage step writes advantage (and returns, with a critic)
critic     writes values; teacher writes teacher_topk_ids / teacher_topk_logprobs
Per-token columns are aligned with response_ids.
"""

from meshy.dataplane.schema import Column, TableSpec

PROMPT_IDS = "prompt_ids"
RESPONSE_IDS = "response_ids"
ROLLOUT_LOGPROBS = "rollout_logprobs"
TOKEN_VERSIONS = "token_versions"
FINISH_REASON = "finish_reason"
TRUNCATED = "truncated"
ERROR = "error"
REWARD = "reward"
ADVANTAGE = "advantage"
RETURNS = "returns"
VALUES = "values"
REF_LOGPROBS = "ref_logprobs"
TEACHER_TOPK_IDS = "teacher_topk_ids"
TEACHER_TOPK_LOGPROBS = "teacher_topk_logprobs"


def rollout_table(
    name: str = "rollout",
    group_size: int = 1,
    teacher_topk: int = 0,
    retire_after: tuple[str, ...] = (),
    max_row_bytes: int = 64 << 20,
) -> TableSpec:
    ragged_int, ragged_float = (None,), (None,)
    columns = [
        Column(PROMPT_IDS, "int64", ragged_int),
        Column(RESPONSE_IDS, "int64", ragged_int),
        Column(ROLLOUT_LOGPROBS, "float32", ragged_float),
        Column(TOKEN_VERSIONS, "int64", ragged_int),
        Column(FINISH_REASON, "str"),
        Column(TRUNCATED, "bool"),
        Column(ERROR, "str"),
        Column(REWARD, "float32"),
        Column(ADVANTAGE, "float32", ragged_float),
        Column(RETURNS, "float32", ragged_float),
        Column(VALUES, "float32", ragged_float),
        Column(REF_LOGPROBS, "float32", ragged_float),
    ]
    if teacher_topk:
        columns += [
            Column(TEACHER_TOPK_IDS, "int64", (None, teacher_topk)),
            Column(TEACHER_TOPK_LOGPROBS, "float32", (None, teacher_topk)),
        ]
    return TableSpec(
        name, tuple(columns), group_size=group_size, max_row_bytes=max_row_bytes, retire_after=retire_after
    )
