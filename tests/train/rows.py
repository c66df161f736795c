"""Synthetic rollout rows for the training tests."""

import torch

from meshy.dataplane import HOST, DataPlaneClient
from meshy.dataplane import columns as cols


def put_groups(
    client: DataPlaneClient,
    table: str,
    groups: range,
    group_size: int,
    vocab: int,
    version: int = 0,
    seed: int = 0,
) -> list[int]:
    """Complete rows (prompt, response, logprobs, versions, advantage) for each group; returns row ids."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for group in groups:
        prompt = torch.randint(0, vocab, (int(torch.randint(2, 5, (), generator=g)),), generator=g)
        ids = [group * group_size + k for k in range(group_size)]
        responses = [torch.randint(0, vocab, (int(torch.randint(1, 6, (), generator=g)),), generator=g) for _ in ids]
        rewards = torch.rand(group_size, generator=g)
        advantages = rewards - rewards.mean()
        client.put(table, ids, {cols.PROMPT_IDS: [prompt] * group_size}, group_ids=[group] * group_size)
        client.add_columns(
            table,
            ids,
            {
                cols.RESPONSE_IDS: responses,
                cols.ROLLOUT_LOGPROBS: [-torch.rand(len(r), generator=g) - 0.5 for r in responses],
                cols.TOKEN_VERSIONS: [torch.full((len(r),), version) for r in responses],
                cols.ADVANTAGE: [torch.full((len(r),), float(a)) for r, a in zip(responses, advantages, strict=True)],
            },
        )
        rows += ids
    return rows


def add_routing(
    client: DataPlaneClient, table: str, rows: list[int], layers: int, top_k: int, experts: int, seed: int = 0
) -> dict[int, torch.Tensor]:
    """A routed_experts column for rows whose responses are written: distinct random experts per token
    and layer. Returns each row's value."""
    lengths = response_lengths(client, table)
    g = torch.Generator(HOST).manual_seed(seed)
    values = {
        r: torch.rand(lengths[r], layers, experts, generator=g, device=HOST).argsort(-1)[..., :top_k].to(torch.int16)
        for r in rows
    }
    client.add_columns(table, rows, {cols.ROUTED_EXPERTS: [values[r] for r in rows]})
    return values


def response_lengths(client: DataPlaneClient, table: str) -> dict[int, int]:
    """Row id -> response tokens, for every row whose response is written."""
    batch = client.lease(table, "response-lengths", [cols.RESPONSE_IDS], count=1024, min_count=1, timeout=3)
    client.release(batch)
    return {r: len(response) for r, response in zip(batch.row_ids, batch.columns[cols.RESPONSE_IDS], strict=True)}
