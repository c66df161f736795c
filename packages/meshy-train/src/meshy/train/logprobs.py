"""Per-token log-probabilities of the trained tokens, in float32.

Sequences are prompt + response, right-padded; a causal model sees no padding before a real token,
so padding needs no attention mask. Position t predicts token t + 1.
"""

import torch
import torch.nn.functional as F

from meshy.dataplane import HOST
from meshy.train.shared_prompts import SharedPrompts


def pack_rows(prompts: list[torch.Tensor], responses: list[torch.Tensor]) -> tuple[torch.Tensor, list[slice]]:
    """Right-padded prompt + response tokens [B, T] (T >= 2), and for each row the span of positions
    whose labels are its response tokens."""
    rows = [torch.cat((p.to(HOST), r.to(HOST))) for p, r in zip(prompts, responses, strict=True)]
    tokens = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    if tokens.shape[1] < 2:
        tokens = F.pad(tokens, (0, 2 - tokens.shape[1]))
    return tokens, [slice(len(p) - 1, len(p) - 1 + len(r)) for p, r in zip(prompts, responses, strict=True)]


def response_positions(prompt_lengths: list[int], response_lengths: list[int], width: int) -> torch.Tensor:
    """Where each response token's predicting position lies in a [B, width] batch of pack_rows'
    positions flattened to [B * width], every row's in order (row b's at b * width + its span)."""
    lengths = torch.tensor(response_lengths, dtype=torch.int64, device=HOST)
    firsts = torch.arange(len(lengths), device=HOST) * width + torch.tensor(prompt_lengths, device=HOST) - 1
    starts = torch.cumsum(lengths, 0) - lengths  # each row's first token among all of them
    within = torch.arange(int(lengths.sum()), device=HOST) - torch.repeat_interleave(starts, lengths)
    return torch.repeat_interleave(firsts, lengths) + within


def forward_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Float32 logits [B, T-1, V] for predicting tokens[:, 1:] from tokens[:, :-1]."""
    return model(tokens[:, :-1]).float()


def response_logits(
    model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor, packed: SharedPrompts | None = None
) -> torch.Tensor:
    """Float32 logits [N, V] at the N `positions` ([B, T-1] bool) of forward_logits' [B, T-1, V], computed
    only there: the vocabulary-wide output projection, and every per-token op after it, skip the prompt's
    and the padding's positions (most of a batch's positions when responses are short). The decoder
    returns its final hidden states (torchtitan's `_skip_lm_head`, as its chunked loss uses it). With
    `packed`, the decoder runs on the rows packed by shared prompt instead (meshy.train.shared_prompts)."""
    model._skip_lm_head = True
    try:
        if packed is None:
            hidden = model(tokens[:, :-1])[positions]
        else:
            hidden = model(packed.tokens, packed.positions, packed.attention).flatten(0, 1)[packed.index[positions]]
    finally:
        model._skip_lm_head = False
    return model.lm_head(hidden).float()


def spread(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-position values [N] back in place [B, T-1] (0 elsewhere); gradients flow to `values`."""
    return torch.zeros(positions.shape, dtype=values.dtype, device=values.device).masked_scatter(positions, values)


def full_log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log-softmax over the vocabulary [B, T-1, V], float32, at the sampling temperature."""
    if temperature != 1.0:
        logits = logits / temperature
    return F.log_softmax(logits.float(), dim=-1)


def picked_logprobs(log_probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) [N] from the full log-softmax [N, V] of each of N positions."""
    return torch.gather(log_probs, -1, labels.unsqueeze(-1)).squeeze(-1)


def label_logprobs(log_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]) as [B, T-1], picked from a full log-softmax."""
    return picked_logprobs(log_probs, tokens[:, 1:])


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]) as [B, T-1] float32, at the sampling temperature."""
    return label_logprobs(full_log_probs(logits, temperature), tokens)
