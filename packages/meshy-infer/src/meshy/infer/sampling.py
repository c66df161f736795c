"""The next token of every running request at once, on the device, with counter-based randomness.

A request's k-th token is drawn with a uniform that is a hash of (its seed, k), not a call on a
generator object: its tokens depend only on its seed, never on what else is in the batch, when it was
admitted or how often its cache was recomputed; and a whole batch is sampled in a few kernels, with no
launch per request. The hash is three rounds of MurmurHash3's 32-bit finaliser (a bijection, so one
request never repeats a uniform), computed in int64 lanes without overflow.

A row is drawn from softmax(logits / temperature), truncated to its top k, then to its top-p nucleus
(renormalised), by inverting the CDF at its uniform; temperature 0 is greedy. The logprob reported is
that of the chosen token under the untruncated tempered distribution, as the trainer computes it.
"""

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_FMIX = (0x85EBCA6B, 0xC2B2AE35)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 x in [0, 2**32): split into 16-bit halves so no product
    leaves int64."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX[0])
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX[1])
    return h ^ (h >> 16)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1) with 24 random bits, one per (seed, counter) pair of int64 tensors
    (seeds taken modulo 2**64 as two 32-bit halves, counters modulo 2**32)."""
    low, high = seeds & MASK32, (seeds >> 32) & MASK32
    h = _fmix32((counters & MASK32) ^ _GOLDEN)
    h = _fmix32(h ^ high)
    h = _fmix32(h ^ low)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass
class Rows:
    """Per-row sampling settings, as device tensors [rows]. top_k is already vocab where it is off."""

    temperature: torch.Tensor  # float32; 0: greedy
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32
    seed: torch.Tensor  # int64
    counter: torch.Tensor  # int64: the index of the token being drawn in the request's output
    truncated: bool  # some row has top_k < vocab or top_p < 1 (known on the host: no sync to find out)


def sample(logits: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token [rows] (int64) and its logprob [rows] (float32) from float32 logits [rows, vocab]."""
    vocab = logits.shape[-1]
    greedy = rows.temperature == 0
    scaled = logits / torch.where(greedy, 1.0, rows.temperature)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    u = uniforms(rows.seed, rows.counter)[:, None]
    drawn = _invert(logprobs.exp().cumsum(dim=-1), u, vocab)[:, 0]  # in vocabulary order
    if rows.truncated:  # truncated rows invert their CDF in descending order; the others keep theirs
        ordered, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        probs = torch.softmax(ordered.masked_fill(rank >= rows.top_k[:, None], -torch.inf), dim=-1)
        beyond = probs.cumsum(dim=-1) - probs >= rows.top_p[:, None]  # the tokens before hold p already
        cdf = probs.masked_fill(beyond, 0.0).cumsum(dim=-1)
        truncated = (rows.top_k < vocab) | (rows.top_p < 1)
        drawn = torch.where(truncated, order.gather(1, _invert(cdf, u, vocab))[:, 0], drawn)
    chosen = torch.where(greedy, logits.argmax(dim=-1), drawn)
    return chosen, logprobs.gather(1, chosen[:, None])[:, 0]


def _invert(cdf: torch.Tensor, u: torch.Tensor, vocab: int) -> torch.Tensor:
    """The first index whose cumulative mass exceeds u of the row's total, [rows, 1]."""
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=vocab - 1)
