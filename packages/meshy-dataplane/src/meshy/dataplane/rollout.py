"""The rollout table: the columns RL roles exchange, defined once for every role.

rollout    writes prompt_ids (and group ids: the n samples of one prompt form a group)
inference  writes response_ids, rollout_logprobs, token_versions, finish_reason, truncated (or error),
           and routed_experts when the run replays a mixture-of-experts model's routing
reward     writes reward; the advantage step writes advantage (and returns, with a critic)
critic     writes values; teacher writes teacher_topk_ids / teacher_topk_logprobs
Per-token columns are aligned with response_ids. routed_experts [response tokens, layers, top_k] int16:
entry i is the experts every MoE layer chose at the position whose logits gave response token i (the
prompt's last position for token 0), the routing the trainer replays there. Only a table made for
routing replay declares it: dense models, and runs that do not replay, carry no such column at all, so
no row pays for it and no consumer has to tell an empty value from a missing one.
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
ROUTED_EXPERTS = "routed_experts"


def rollout_table(
    name: str = "rollout",
    group_size: int = 1,
    teacher_topk: int = 0,
    routed_experts: tuple[int, int] | None = None,
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
    if routed_experts is not None:  # (MoE layers, experts per token)
        columns.append(Column(ROUTED_EXPERTS, "int16", (None, *routed_experts)))
    return TableSpec(
        name, tuple(columns), group_size=group_size, max_row_bytes=max_row_bytes, retire_after=retire_after
    )
