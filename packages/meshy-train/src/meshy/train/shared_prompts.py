"""Rows that share a prompt (a GRPO group's) trained with the prompt computed once.

Each distinct prompt becomes one packed sequence: the prompt, then every response that follows it (each
without its last token, which predicts nothing trained). A response's tokens attend to the prompt and
to the response's own earlier tokens only (a block mask), at the positions they have in their own row, so
every trained position sees exactly what it sees in its row: the logits are the row layout's, up to
float rounding. A group of k rows whose prompt is P tokens and responses R costs P + k (R - 1) tokens of
forward and backward instead of k (P + R): most of the work when responses are short next to prompts.

The mask is dense ([L, L] per packed sequence), so packing is used only where it saves work and the
packed sequences stay short (meshy.train.shared_prompts.MAX_PACKED_TOKENS).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_PACKED_TOKENS = 2048  # the longest packed sequence: its mask is L x L booleans
MIN_SAVING = 0.25  # pack only when it saves at least this share of the forward's tokens


@dataclass
class SharedPrompts:
    """tokens, positions: [G, L] (right-padded). attention: [G, 1, L, L] bool, True where a query may
    attend to a key. index: [B, T-1] int64, where each position of the row layout (pack_rows: position t
    predicts token t + 1 of row b) lies in the packed sequences flattened to [G * L]; only the positions
    that predict response tokens are meaningful."""

    tokens: torch.Tensor
    positions: torch.Tensor
    attention: torch.Tensor
    index: torch.Tensor

    def to(self, device: torch.device) -> "SharedPrompts":
        return SharedPrompts(*(t.to(device) for t in (self.tokens, self.positions, self.attention, self.index)))


def pack_shared_prompts(
    prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], width: int
) -> SharedPrompts | None:
    """The rows (prompt + response each, laid out by pack_rows in a [B, width] batch) packed by prompt, or
    None where that would not save MIN_SAVING of the tokens or would pass MAX_PACKED_TOKENS."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt.tolist()), []).append(b)
    lengths = [len(p) + sum(max(len(responses[b]) - 1, 0) for b in rows) for p, rows in groups.items()]
    unpacked = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    if max(lengths) > MAX_PACKED_TOKENS or sum(lengths) > (1 - MIN_SAVING) * unpacked:
        return None
    device = prompts[0].device
    g, length = len(groups), max(lengths)
    tokens = torch.zeros(g, length, dtype=torch.int64, device=device)
    positions = torch.zeros(g, length, dtype=torch.int64, device=device)
    segment = torch.full((g, length), -1, dtype=torch.int64, device=device)  # -1: the prompt
    index = torch.zeros(len(prompts), width - 1, dtype=torch.int64, device=device)
    for i, (prompt, rows) in enumerate(groups.items()):
        p = len(prompt)
        tokens[i, :p] = prompts[rows[0]]
        positions[i, :p] = torch.arange(p, device=device)
        start = p
        for b in rows:
            r = len(responses[b])
            inputs = responses[b][: r - 1]
            end = start + len(inputs)
            tokens[i, start:end] = inputs
            positions[i, start:end] = torch.arange(p, p + len(inputs), device=device)
            segment[i, start:end] = b
            index[b, p - 1] = i * length + p - 1  # the prompt's last position predicts the first token
            index[b, p : p - 1 + r] = i * length + torch.arange(start, end, device=device)
            start = end
        segment[i, start:] = -2 - torch.arange(length - start, device=device)  # padding: itself only
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    same = (segment[:, :, None] == segment[:, None, :]) | (segment[:, None, :] == -1)
    return SharedPrompts(tokens, positions, (same & causal)[:, None], index)
