"""The batched sampler: the right distribution, and each request's tokens a function of its seed alone."""

import pytest
import torch

from meshy.infer.sampling import MASK32, Rows, _mul32, sample, uniforms


def fmix32_reference(h: int) -> int:
    """MurmurHash3's 32-bit finaliser on Python ints (no overflow possible)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def uniform_reference(seed: int, counter: int) -> float:
    seed %= 1 << 64
    h = fmix32_reference((counter & MASK32) ^ 0x9E3779B9)
    h = fmix32_reference(h ^ (seed >> 32))
    h = fmix32_reference(h ^ (seed & MASK32))
    return (h >> 8) / (1 << 24)


def rows(n: int, temperature=1.0, top_k=0, top_p=1.0, seeds=None, counters=None, vocab=8) -> Rows:
    seeds = torch.arange(n, dtype=torch.int64) if seeds is None else torch.as_tensor(seeds, dtype=torch.int64)
    counters = torch.zeros(n, dtype=torch.int64) if counters is None else torch.as_tensor(counters, dtype=torch.int64)
    full = lambda value, dtype: torch.as_tensor(value, dtype=dtype).expand(n).clone()  # noqa: E731
    top_k = torch.where(full(top_k, torch.int64) == 0, vocab, full(top_k, torch.int64))
    top_p = full(top_p, torch.float32)
    return Rows(
        full(temperature, torch.float32),
        top_k,
        top_p,
        seeds,
        counters,
        bool((top_k < vocab).any() or (top_p < 1).any()),
    )


def test_the_hash_is_exact_in_int64_lanes_for_every_seed_and_counter():
    extremes = [0, 1, 2**31, MASK32, 2**32, 2**63 - 1, -1, -(2**63), 12345678901234]
    counters = [0, 1, 7, MASK32, 2**40 + 3]
    x = torch.tensor([0, 1, 0xFFFF, 2**31, MASK32], dtype=torch.int64)
    assert _mul32(x, 0xC2B2AE35).tolist() == [(v * 0xC2B2AE35) & MASK32 for v in x.tolist()]
    seeds = torch.tensor([s for s in extremes for _ in counters], dtype=torch.int64)
    steps = torch.tensor(counters * len(extremes), dtype=torch.int64)
    got = uniforms(seeds, steps).tolist()
    assert got == [uniform_reference(s, c) for s in extremes for c in counters]
    assert all(0 <= u < 1 for u in got)


def test_uniforms_are_uniform_distinct_per_counter_and_uncorrelated_across_seeds():
    counters = torch.arange(100_000, dtype=torch.int64)
    one_seed = uniforms(torch.full_like(counters, 42), counters)
    assert len(torch.unique(one_seed)) > 99_000  # 24-bit values: a few birthday collisions at most
    histogram = torch.histc(one_seed, bins=20, min=0, max=1)
    assert (histogram - 5000).abs().max() < 5 * 5000**0.5
    neighbours = uniforms(torch.arange(100_000, dtype=torch.int64), torch.zeros_like(counters))
    next_seed = uniforms(torch.arange(1, 100_001, dtype=torch.int64), torch.zeros_like(counters))
    correlation = torch.corrcoef(torch.stack([neighbours, next_seed]))[0, 1]
    assert abs(correlation) < 0.02
    assert abs(torch.corrcoef(torch.stack([one_seed[:-1], one_seed[1:]]))[0, 1]) < 0.02


LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0, -1e4, -1e4, -1e4])


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_the_tempered_softmax_and_logprobs_are_untruncated(temperature):
    n = 20_000
    tokens, logprobs = sample(LOGITS.expand(n, 8), rows(n, temperature=temperature))
    expected = torch.softmax(LOGITS / temperature, -1)
    counts = torch.bincount(tokens, minlength=8).float()
    assert counts[5:].sum() == 0, "tokens of (near) zero probability are never drawn"
    assert torch.all((counts[:4] - n * expected[:4]).abs() <= 5 * (n * expected[:4]).sqrt() + 3), counts
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS / temperature, -1)[tokens])


def test_top_k_and_top_p_truncate_and_renormalise():
    n = 20_000
    tokens, logprobs = sample(LOGITS.expand(n, 8), rows(n, top_k=3))
    counts = torch.bincount(tokens, minlength=8).float()
    expected = torch.softmax(LOGITS[:3], -1) * n
    assert counts[3:].sum() == 0 and torch.all((counts[:3] - expected).abs() <= 5 * expected.sqrt() + 3), counts
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS, -1)[tokens]), "logprobs ignore truncation"
    probs = torch.softmax(LOGITS, -1)  # 0.64, 0.24, 0.09, ...: a nucleus of 0.8 keeps the first two
    tokens, _ = sample(LOGITS.expand(n, 8), rows(n, top_p=0.8))
    counts = torch.bincount(tokens, minlength=8).float()
    expected = probs[:2] / probs[:2].sum() * n
    assert counts[2:].sum() == 0 and torch.all((counts[:2] - expected).abs() <= 5 * expected.sqrt() + 3), counts


def test_a_request_s_token_depends_on_its_seed_and_counter_only():
    logits = torch.randn(6, 512, generator=torch.Generator().manual_seed(5))
    seeds, counters = [11, 12, 13, 14, 15, 16], [0, 3, 9, 1, 0, 2]
    mixed = Rows(
        torch.tensor([1.0, 0.7, 0.0, 1.0, 1.3, 1.0]),
        torch.tensor([512, 512, 512, 40, 512, 512]),
        torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.9]),
        torch.tensor(seeds),
        torch.tensor(counters),
        True,
    )
    together, _ = sample(logits, mixed)
    for i in range(6):
        alone = Rows(
            mixed.temperature[i : i + 1],
            mixed.top_k[i : i + 1],
            mixed.top_p[i : i + 1],
            mixed.seed[i : i + 1],
            mixed.counter[i : i + 1],
            bool(mixed.top_k[i] < 512 or mixed.top_p[i] < 1),
        )
        assert sample(logits[i : i + 1], alone)[0].item() == together[i].item(), i
    assert together[2] == logits[2].argmax(), "temperature 0 is greedy"
    again, _ = sample(logits, mixed)
    assert torch.equal(again, together)
    moved = Rows(mixed.temperature, mixed.top_k, mixed.top_p, mixed.seed, mixed.counter + 1, True)
    assert not torch.equal(sample(logits, moved)[0], together), "the next token draws a new uniform"
