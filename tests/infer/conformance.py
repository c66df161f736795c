"""Conformance cases every Engine passes, whatever runs behind it.

A test module subclasses EngineConformance (pytest collects the cases from the subclass) and provides
two fixtures: `engine`, a fresh engine closed after the test (closing twice must be a no-op), and
`engine_spec`, an EngineSpec. The model should have sharp enough distributions that greedy output
varies from token to token and does not end in EOS within max_len for the prompts below.
The probe idiom: a one-token generation sent after a request returns only once that request was
admitted (admission is first come, first served), so that request has produced at least one token.
"""

import asyncio
import functools
import random
import time
from dataclasses import dataclass, replace

import pytest
import torch

from meshy.dataplane import SchemaError
from meshy.dataplane.adapters import Adapter, adapter_names, split_version
from meshy.dataplane.weights import CorruptWeights, tensors_checksum
from meshy.infer.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Engine, SamplingParams, WeightsSource

TOLERANCE = 1e-5


@dataclass(frozen=True)
class Update:
    """A version to update to: `update_weights(version, source, adapter)`."""

    version: int
    source: WeightsSource
    adapter: Adapter | None = None


@dataclass(frozen=True)
class LoraSpec:
    """LoRA versions on one base, as the collective delivers them (in-memory tensors, with the announcement's
    Adapter): `with_base` carries the base and adapters; `adapters_only` other adapters (nonzero B) on that
    base, without it; `merged` the whole model that `adapters_only` makes of the base (no adapters); `foreign`
    adapters on another base. `lora_spec` builds them from a base's HF tensors."""

    with_base: Update
    adapters_only: Update
    merged: Update
    foreign: Update


@dataclass(frozen=True)
class EngineSpec:
    """What the cases need to know about the engine under test: its vocabulary, its max_len, a second
    weights version (with other outputs) to update to, and LoRA versions if the engine applies adapters
    (the LoRA cases are skipped without)."""

    vocab_size: int
    max_len: int
    new_version: int
    new_weights: WeightsSource
    lora: LoraSpec | None = None


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapters(base: dict[str, torch.Tensor], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Adapters under PEFT's names for every LORA_TARGETS projection of `base`, B nonzero."""
    generator = torch.Generator().manual_seed(seed)
    adapters = {}
    for name, weight in base.items():
        if name.split(".")[-2] in LORA_TARGETS:
            a_name, b_name = adapter_names(name)
            out, size = weight.shape
            adapters[a_name] = torch.randn(rank, size, generator=generator, dtype=weight.dtype) / size**0.5
            adapters[b_name] = torch.randn(out, rank, generator=generator, dtype=weight.dtype) * 0.1
    return adapters


def merged_weights(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float) -> dict:
    """`base` with every adapter merged in (W + scale * B A, in float32)."""
    _, pairs = split_version(adapters)
    merged = dict(base)
    for name, (a, b) in pairs.items():
        merged[name] = (base[name].float() + scale * (b.float() @ a.float())).to(base[name].dtype)
    return merged


def lora_spec(base: dict[str, torch.Tensor], other_base: dict[str, torch.Tensor], first_version: int) -> LoraSpec:
    """LoRA versions first_version.. on `base` (rank 4, alpha 8), the foreign one on `other_base`."""
    checksum = tensors_checksum(base)
    adapter = Adapter(rank=4, alpha=8.0, target_modules=LORA_TARGETS, base=checksum)
    first, second = random_adapters(base, 4, seed=1), random_adapters(base, 4, seed=2)
    foreign = replace(adapter, base=tensors_checksum(other_base))
    return LoraSpec(
        with_base=Update(first_version, {**base, **first}, adapter),
        adapters_only=Update(first_version + 1, second, adapter),
        merged=Update(first_version + 2, merged_weights(base, second, adapter.scale)),
        foreign=Update(first_version + 3, random_adapters(other_base, 4, seed=3), foreign),
    )


def async_case(case):
    """Runs a coroutine test in its own event loop (pytest still sees the fixtures it names)."""

    @functools.wraps(case)
    def run(*args, **kwargs):
        return asyncio.run(case(*args, **kwargs))

    return run


def greedy(max_new_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens, temperature=0.0, **kwargs)


def prompt(seed: int, length: int = 6, vocab_size: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


async def probe(engine: Engine) -> None:
    """Returns once every generate task created before it was admitted (first come, first served)."""
    for _ in range(10):  # let those tasks run up to their submission
        await asyncio.sleep(0)
    await engine.generate("probe", prompt(999), greedy(1))


async def timed_generate(engine: Engine, request_id: str, input_ids: list[int], params: SamplingParams):
    """The generation and how long it took, so waits that prove a stall can scale with the machine."""
    start = time.perf_counter()
    result = await engine.generate(request_id, input_ids, params)
    return result, time.perf_counter() - start


async def stalls(task: asyncio.Task, seconds: float) -> bool:
    """True if the task is still not done after `seconds` (at least 0.3)."""
    await asyncio.sleep(max(seconds, 0.3))
    return not task.done()


def full_logprobs(scores, vocab_size: int) -> torch.Tensor:
    """[positions, vocab] from a score with top_k = vocab_size."""
    out = torch.empty(len(scores.topk_ids), vocab_size, dtype=torch.float64)
    out.scatter_(1, torch.tensor(scores.topk_ids), torch.tensor(scores.topk_logprobs, dtype=torch.float64))
    return out


def bad_inputs(vocab: int, max_len: int) -> dict[str, tuple[str, tuple, str]]:
    """name -> (method, its arguments, the error they get): every input the Engine layer refuses."""
    in_vocab = rf"expected a token id in the vocabulary \[0, {vocab}\)"
    return {
        "request-id-not-str": ("generate", (7, [5], greedy(2)), "request_id: expected a str, got int 7"),
        "params-not-sampling-params": (
            "generate",
            ("p", [5], {"max_new_tokens": 2}),
            "params: expected SamplingParams",
        ),
        "prompt-not-a-list": ("generate", ("s", "5 6", greedy(2)), "input_ids: expected a list of token ids, got str"),
        "empty-prompt": ("generate", ("e", [], greedy(2)), "input_ids: empty; expected at least one token id"),
        "id-past-vocab": ("generate", ("v", [1, vocab], greedy(2)), rf"input_ids\[1\]: {in_vocab}, got {vocab}"),
        "negative-id": ("generate", ("n", [-1, 4], greedy(2)), rf"input_ids\[0\]: {in_vocab}, got -1"),
        "float-id": ("generate", ("f", [4, 2.0], greedy(2)), rf"input_ids\[1\]: {in_vocab}, got 2.0"),
        "bool-id": ("generate", ("b", [True], greedy(2)), rf"input_ids\[0\]: {in_vocab}, got True"),
        "stop-id-past-vocab": (
            "generate",
            ("t", [5], greedy(2, stop_token_ids=(3, vocab))),
            rf"params.stop_token_ids\[1\]: {in_vocab}, got {vocab}",
        ),
        "prompt-and-output-past-max-len": (
            "generate",
            ("l", [5] * 10, greedy(max_len - 9)),
            rf"input_ids \+ params.max_new_tokens: 10 \+ {max_len - 9} = {max_len + 1} tokens, beyond the "
            rf"engine's max_len of {max_len}",
        ),
        "score-empty": ("score", ([],), "input_ids: empty"),
        "score-id-past-vocab": ("score", ([3, vocab + 7],), rf"input_ids\[1\]: {in_vocab}, got {vocab + 7}"),
        "score-past-max-len": (
            "score",
            ([5] * (max_len + 1),),
            f"score input_ids: {max_len + 1} tokens, beyond the engine's max_len of {max_len}",
        ),
        "score-top-k-past-vocab": ("score", ([5, 6], vocab + 1), f"score top_k: expected 0..{vocab}, got {vocab + 1}"),
        "score-start-past-end": ("score", ([5, 6], 0, 2), "score start: expected a position in 0..1, got 2"),
    }


BAD_INPUTS = sorted(bad_inputs(vocab=512, max_len=96))  # the case names, the same for every engine


def lora_or_skip(spec: EngineSpec) -> LoraSpec:
    if spec.lora is None:
        pytest.skip("the engine's spec has no LoRA versions")
    return spec.lora


def max_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


class EngineConformance:
    @async_case
    async def test_greedy_is_deterministic(self, engine, engine_spec):
        ids = prompt(1, vocab_size=engine_spec.vocab_size)
        first = await engine.generate("a", ids, greedy(12))
        second = await engine.generate("b", ids, greedy(12))
        assert first.output_ids == second.output_ids and first.logprobs == second.logprobs
        assert len(set(first.output_ids)) > 1, "the test model should not repeat one token"
        assert (first.finish_reason, first.prompt_length, first.request_id) == (FINISH_LENGTH, len(ids), "a")
        assert first.token_versions == [engine.weight_version] * 12
        assert all(lp <= 0 for lp in first.logprobs)

    @async_case
    async def test_same_seed_same_tokens_other_seed_other_tokens(self, engine, engine_spec):
        ids = prompt(2, vocab_size=engine_spec.vocab_size)
        runs = [await engine.generate(f"r{seed}", ids, SamplingParams(16, seed=seed)) for seed in (7, 7, 8)]
        assert runs[0].output_ids == runs[1].output_ids
        assert runs[0].logprobs == pytest.approx(runs[1].logprobs, abs=TOLERANCE)
        assert runs[0].output_ids != runs[2].output_ids

    @async_case
    async def test_batched_results_equal_single_results(self, engine, engine_spec):
        params = [
            greedy(10 + i) if i % 2 else SamplingParams(10 + i, temperature=0.8, top_k=20, top_p=0.9, seed=i)
            for i in range(10)
        ]
        prompts = [prompt(10 + i, length=3 + i, vocab_size=engine_spec.vocab_size) for i in range(10)]
        alone = [await engine.generate(f"alone{i}", p, s) for i, (p, s) in enumerate(zip(prompts, params, strict=True))]

        async def staggered(i: int):
            await asyncio.sleep(0.004 * i)
            return await engine.generate(f"batched{i}", prompts[i], params[i])

        batched = await asyncio.gather(*(staggered(i) for i in range(10)))
        for one, many in zip(alone, batched, strict=True):
            assert many.output_ids == one.output_ids and many.finish_reason == one.finish_reason
            assert many.logprobs == pytest.approx(one.logprobs, abs=TOLERANCE)

    @async_case
    async def test_stop_token_ends_with_stop_and_is_included(self, engine, engine_spec):
        ids = prompt(3, vocab_size=engine_spec.vocab_size)
        reference = await engine.generate("ref", ids, greedy(20))
        k = max(i for i, token in enumerate(reference.output_ids) if token not in reference.output_ids[:i])
        assert k > 0
        stopped = await engine.generate("stop", ids, greedy(20, stop_token_ids=(reference.output_ids[k],)))
        assert stopped.finish_reason == FINISH_STOP
        assert stopped.output_ids == reference.output_ids[: k + 1]
        assert len(stopped.logprobs) == len(stopped.token_versions) == k + 1

    @async_case
    async def test_max_new_tokens_ends_with_length(self, engine, engine_spec):
        ids = prompt(4, vocab_size=engine_spec.vocab_size)
        five = await engine.generate("five", ids, greedy(5))
        assert (len(five.output_ids), len(five.logprobs), five.finish_reason) == (5, 5, FINISH_LENGTH)
        none = await engine.generate("none", ids, greedy(0))
        assert (none.output_ids, none.logprobs, none.token_versions, none.finish_reason) == ([], [], [], FINISH_LENGTH)
        full = await engine.generate("full", ids, greedy(engine_spec.max_len - len(ids)))
        assert len(full.output_ids) == engine_spec.max_len - len(ids)

    @async_case
    async def test_abort_returns_the_partial_output(self, engine, engine_spec):
        ids = prompt(5, vocab_size=engine_spec.vocab_size)
        budget = engine_spec.max_len - len(ids)
        reference = await engine.generate("ref", ids, greedy(budget))
        task = asyncio.create_task(engine.generate("long", ids, greedy(budget)))
        await probe(engine)
        await engine.abort("long")
        aborted = await task
        assert aborted.finish_reason == FINISH_ABORT
        assert 1 <= len(aborted.output_ids) < budget
        assert aborted.output_ids == reference.output_ids[: len(aborted.output_ids)]
        await engine.abort("long")  # finished: a no-op
        await engine.abort("never-seen")
        assert (await engine.generate("after", ids, greedy(3))).output_ids == reference.output_ids[:3]

    @async_case
    async def test_pause_stops_progress_and_resume_continues(self, engine, engine_spec):
        ids, later_ids = prompt(6, vocab_size=engine_spec.vocab_size), prompt(7, vocab_size=engine_spec.vocab_size)
        budget = engine_spec.max_len - len(ids)
        reference, seconds = await timed_generate(engine, "ref", ids, greedy(budget))
        later_reference = await engine.generate("later-ref", later_ids, greedy(8))
        running = asyncio.create_task(engine.generate("running", ids, greedy(budget)))
        await probe(engine)
        await engine.pause()
        later = asyncio.create_task(engine.generate("later", later_ids, greedy(8)))
        assert await stalls(running, 2 * seconds) and not later.done()
        await engine.resume()
        assert (await running).output_ids == reference.output_ids
        assert (await later).output_ids == later_reference.output_ids

    @async_case
    async def test_weight_update_mid_generation_keeps_each_tokens_version(self, engine, engine_spec):
        ids = prompt(8, vocab_size=engine_spec.vocab_size)
        budget = engine_spec.max_len - len(ids)
        old_version = engine.weight_version
        reference = await engine.generate("ref", ids, greedy(budget))
        task = asyncio.create_task(engine.generate("long", ids, greedy(budget)))
        await probe(engine)
        await engine.pause()  # no tokens between here and the update: both versions must appear
        await engine.update_weights(engine_spec.new_version, engine_spec.new_weights)
        assert engine.weight_version == engine_spec.new_version
        await engine.resume()
        result = await task
        switch = result.token_versions.index(engine_spec.new_version)
        assert result.token_versions == [old_version] * switch + [engine_spec.new_version] * (budget - switch)
        assert 0 < switch < budget
        assert result.finish_reason == FINISH_LENGTH and len(result.output_ids) == len(result.logprobs) == budget
        assert result.output_ids[:switch] == reference.output_ids[:switch]
        fresh = await engine.generate("fresh", ids, greedy(budget))
        assert fresh.output_ids != reference.output_ids
        assert fresh.token_versions == [engine_spec.new_version] * budget

    @async_case
    async def test_generation_logprobs_equal_score_logprobs(self, engine, engine_spec):
        ids = prompt(9, vocab_size=engine_spec.vocab_size)
        for name, params in [("greedy", greedy(16)), ("sampled", SamplingParams(16, seed=3))]:
            result = await engine.generate(name, ids, params)
            scores = await engine.score(ids + result.output_ids, top_k=4, start=len(ids) - 1)
            assert scores.token_logprobs == pytest.approx(result.logprobs, abs=TOLERANCE), name
            assert len(scores.topk_ids) == len(scores.topk_logprobs) == len(result.output_ids)
            assert all(row == sorted(row, reverse=True) for row in scores.topk_logprobs)
            if name == "greedy":
                assert [row[0] for row in scores.topk_ids] == result.output_ids
        plain = await engine.score([*ids, 5, 6])
        assert len(plain.token_logprobs) == len(ids) + 1 and plain.topk_ids == plain.topk_logprobs == []

    @async_case
    async def test_logprobs_are_taken_at_the_temperature_before_truncation(self, engine, engine_spec):
        ids, temperature = prompt(10, vocab_size=engine_spec.vocab_size), 0.6
        result = await engine.generate("t", ids, SamplingParams(12, temperature=temperature, top_k=5, seed=1))
        scores = await engine.score(ids + result.output_ids, top_k=engine_spec.vocab_size, start=len(ids) - 1)
        tempered = torch.log_softmax(full_logprobs(scores, engine_spec.vocab_size) / temperature, dim=-1)
        expected = tempered.gather(1, torch.tensor(result.output_ids)[:, None])[:, 0].tolist()
        assert result.logprobs == pytest.approx(expected, abs=TOLERANCE)

    @async_case
    async def test_top_k_and_top_p_never_sample_outside_their_set(self, engine, engine_spec):
        ids, vocab = prompt(11, vocab_size=engine_spec.vocab_size), engine_spec.vocab_size
        for seed in range(3):
            top_k = await engine.generate(f"k{seed}", ids, SamplingParams(24, top_k=3, seed=seed))
            scores = await engine.score(ids + top_k.output_ids, top_k=3, start=len(ids) - 1)
            assert all(t in row for t, row in zip(top_k.output_ids, scores.topk_ids, strict=True))
            top_p = await engine.generate(f"p{seed}", ids, SamplingParams(24, top_p=0.5, seed=seed))
            scores = await engine.score(ids + top_p.output_ids, top_k=vocab, start=len(ids) - 1)
            probs = full_logprobs(scores, vocab).exp()
            for position, token in enumerate(top_p.output_ids):
                mass_above = probs[position][probs[position] > probs[position, token]].sum().item()
                assert mass_above < 0.5, f"token {token} at {position} is outside the 0.5 nucleus"

    @pytest.mark.parametrize("case", BAD_INPUTS)
    @async_case
    async def test_each_bad_input_is_refused_by_the_engine_layer_before_the_engine_sees_it(
        self, engine, engine_spec, monkeypatch, case
    ):
        method, args, error = bad_inputs(engine_spec.vocab_size, engine_spec.max_len)[case]

        async def unreachable(*args):
            raise AssertionError(f"the engine itself was called with {args}")

        monkeypatch.setattr(engine, f"_{method}", unreachable)
        with pytest.raises(SchemaError, match=error):
            await getattr(engine, method)(*args)
        with pytest.raises(AssertionError, match="the engine itself was called"):  # good input goes through
            await getattr(engine, method)(*(("ok", [5, 6], greedy(2)) if method == "generate" else ([5, 6],)))

    @async_case
    async def test_a_request_id_is_refused_while_a_request_with_it_runs(self, engine, engine_spec):
        vocab, max_len = engine_spec.vocab_size, engine_spec.max_len
        task = asyncio.create_task(engine.generate("dup", prompt(12, vocab_size=vocab), greedy(max_len - 6)))
        await probe(engine)
        with pytest.raises(ValueError, match="request_id 'dup'.*running"):
            await engine.generate("dup", [5, 6], greedy(2))
        await engine.abort("dup")
        assert (await task).finish_reason == FINISH_ABORT
        assert (await engine.generate("dup", [5, 6], greedy(2))).finish_reason == FINISH_LENGTH

    @async_case
    async def test_release_waits_for_onload_and_keeps_requests(self, engine, engine_spec):
        ids, later_ids = prompt(13, vocab_size=engine_spec.vocab_size), prompt(14, vocab_size=engine_spec.vocab_size)
        budget = engine_spec.max_len - len(ids)
        reference, seconds = await timed_generate(engine, "ref", ids, greedy(budget))
        later_reference = await engine.generate("later-ref", later_ids, greedy(5))
        scored = await engine.score(ids + reference.output_ids)
        running = asyncio.create_task(engine.generate("running", ids, greedy(budget)))
        await probe(engine)
        await engine.release()
        later = asyncio.create_task(engine.generate("later", later_ids, greedy(5)))
        scoring = asyncio.create_task(engine.score(ids + reference.output_ids))
        assert await stalls(running, 2 * seconds) and not later.done() and not scoring.done()
        await engine.onload()
        assert (await running).output_ids == reference.output_ids
        assert (await later).output_ids == later_reference.output_ids
        assert (await scoring).token_logprobs == pytest.approx(scored.token_logprobs, abs=TOLERANCE)

    # LoRA: a version's adapters apply onto the base the engine holds, without reloading it. SGLangEngine
    # runs these through SGLang's LoRA support (a real SGLang, not the CPU tier's stub).

    @async_case
    async def test_lora_adapters_apply_onto_their_base_as_their_merged_weights(self, engine, engine_spec):
        lora = lora_or_skip(engine_spec)
        ids = prompt(16, vocab_size=engine_spec.vocab_size)
        sequence = ids + (await engine.generate("g", ids, greedy(12))).output_ids
        full = await engine.score(sequence)
        scored = {}
        for name in ("with_base", "adapters_only", "merged", "with_base_again"):
            update = getattr(lora, name.removesuffix("_again"))
            await engine.update_weights(update.version, update.source, update.adapter)
            assert engine.weight_version == update.version
            scored[name] = (await engine.score(sequence)).token_logprobs
        # merged: a whole version drops the adapters (else they would apply twice)
        assert scored["adapters_only"] == pytest.approx(scored["merged"], abs=TOLERANCE)
        assert scored["with_base_again"] == pytest.approx(scored["with_base"], abs=TOLERANCE)
        assert max_difference(scored["with_base"], scored["adapters_only"]) > 1e-2, "the adapters change the model"
        assert max_difference(scored["with_base"], full.token_logprobs) > 1e-2

    @async_case
    async def test_lora_adapters_switched_mid_generation_keep_each_tokens_version(self, engine, engine_spec):
        lora = lora_or_skip(engine_spec)
        first, second = lora.with_base, lora.adapters_only
        await engine.update_weights(first.version, first.source, first.adapter)
        ids = prompt(17, vocab_size=engine_spec.vocab_size)
        budget = engine_spec.max_len - len(ids)
        reference = await engine.generate("ref", ids, greedy(budget))
        task = asyncio.create_task(engine.generate("long", ids, greedy(budget)))
        await probe(engine)
        await engine.pause()
        await engine.update_weights(second.version, second.source, second.adapter)
        await engine.resume()
        result = await task
        switch = result.token_versions.index(second.version)
        assert result.token_versions == [first.version] * switch + [second.version] * (budget - switch)
        assert 0 < switch < budget and result.output_ids[:switch] == reference.output_ids[:switch]
        fresh = await engine.generate("fresh", ids, greedy(budget))
        assert fresh.output_ids != reference.output_ids and fresh.token_versions == [second.version] * budget
        scores = await engine.score(ids + fresh.output_ids, start=len(ids) - 1)
        assert scores.token_logprobs == pytest.approx(fresh.logprobs, abs=TOLERANCE)

    @async_case
    async def test_lora_adapters_on_a_base_the_engine_does_not_hold_are_refused(self, engine, engine_spec):
        """CorruptWeights naming both bases (the inference service then asks for a version with its base);
        the engine goes on with what it had."""
        lora = lora_or_skip(engine_spec)
        ids = prompt(18, vocab_size=engine_spec.vocab_size)
        only, held, foreign = lora.adapters_only, lora.with_base.adapter.base, lora.foreign.adapter.base
        for before, update, error in [
            (None, only, f"adapters on the base {held}, but the engine holds no LoRA base"),
            (lora.with_base, lora.foreign, f"adapters on the base {foreign}, but the engine holds the base {held}"),
            (lora.merged, only, f"adapters on the base {held}, but the engine holds no LoRA base"),
        ]:
            if before is not None:
                await engine.update_weights(before.version, before.source, before.adapter)
            version, reference = engine.weight_version, await engine.generate("ref", ids, greedy(8))
            with pytest.raises(CorruptWeights, match=f"v{update.version}: {error}"):
                await engine.update_weights(update.version, update.source, update.adapter)
            after = await engine.generate("after", ids, greedy(8))
            assert engine.weight_version == version and after.output_ids == reference.output_ids
            assert after.logprobs == pytest.approx(reference.logprobs, abs=TOLERANCE)

    @async_case
    async def test_close_ends_pending_generations_as_aborted(self, engine, engine_spec):
        ids = prompt(15, vocab_size=engine_spec.vocab_size)
        task = asyncio.create_task(engine.generate("long", ids, greedy(engine_spec.max_len - len(ids))))
        await probe(engine)
        await engine.close()
        result = await task
        assert result.finish_reason == FINISH_ABORT
        assert len(result.output_ids) == len(result.logprobs) == len(result.token_versions) >= 1
