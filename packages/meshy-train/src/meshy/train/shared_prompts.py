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

from meshy.dataplane import HOST

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
    None where that would not save MIN_SAVING of the tokens or would pass MAX_PACKED_TOKENS. Built in
    Python lists and turned into tensors once: a version's rows are hundreds of short sequences."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt.tolist()), []).append(b)
    ends = [len(r) - 1 for r in responses]  # a response's inputs: all but its last token
    lengths = [len(p) + sum(max(ends[b], 0) for b in rows) for p, rows in groups.items()]
    unpacked = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    if max(lengths) > MAX_PACKED_TOKENS or sum(lengths) > (1 - MIN_SAVING) * unpacked:
        return None
    length = max(lengths)
    tokens, positions, segments = [], [], []
    index_rows, index_columns, index_values = [], [], []
    for g, (prompt, rows) in enumerate(groups.items()):
        p = len(prompt)
        sequence, position, segment = list(prompt), list(range(p)), [-1] * p  # -1: the prompt
        for b in rows:
            inputs = responses[b].tolist()[:-1]
            start = len(sequence)
            sequence += inputs
            position += range(p, p + len(inputs))
            segment += [b] * len(inputs)
            # the prompt's last position predicts the first response token, input k the one after it
            index_rows += [b] * (len(inputs) + 1)
            index_columns += range(p - 1, p + len(inputs))
            index_values += [g * length + p - 1, *range(g * length + start, g * length + start + len(inputs))]
        padding = length - len(sequence)
        tokens.append(sequence + [0] * padding)
        positions.append(position + [0] * padding)
        segments.append(segment + [-2 - k for k in range(padding)])  # padding: itself only
    index = torch.zeros(len(prompts), width - 1, dtype=torch.int64, device=HOST)
    index[index_rows, index_columns] = torch.tensor(index_values, dtype=torch.int64, device=HOST)
    segment = torch.tensor(segments, dtype=torch.int64, device=HOST)
    causal = torch.ones(length, length, dtype=torch.bool, device=HOST).tril()
    same = (segment[:, :, None] == segment[:, None, :]) | (segment[:, None, :] == -1)
    return SharedPrompts(
        torch.tensor(tokens, dtype=torch.int64, device=HOST),
        torch.tensor(positions, dtype=torch.int64, device=HOST),
        (same & causal)[:, None],
        index,
    )
