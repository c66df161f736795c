import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import warnings
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from meshy.dataplane import SchemaError, free_bytes
from meshy.dataplane.adapters import adapter_names
from meshy.dataplane.model_source import read_model
from meshy.dataplane.weights import CorruptWeights, read_published
from meshy.infer.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, EngineClosed, SamplingParams
from meshy.infer.slot_state import HELD, POSITION
from meshy.infer.torch_engine import ADMISSION_SHARE, TorchEngine, _Request, _Scheduler
from meshy.infer.torch_model import DecoderModel, ModelConfig, load_model
from meshy.train.logprobs import forward_logits, token_logprobs
from meshy.train.lora import adapter_tensors
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.publish import DirectoryPublisher, SharedMemoryPublisher, hf_tensors
from meshy.train.training_config import LoraConfig, ParallelConfig
from tests.infer.conformance import EngineConformance, EngineSpec, LoraSpec, async_case, greedy, lora_spec, prompt

ARCH = get_model("qwen3-tiny")
MAX_LEN = 96


def sharp_weights(seed: int) -> dict[str, torch.Tensor]:
    """qwen3-tiny's HF tensors with every matrix scaled 8x: freshly initialised weights give nearly
    uniform next-token distributions, and greedy decoding of tied embeddings repeats its input token."""
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=seed)
    return {name: t * 8 if t.ndim == 2 else t for name, t in hf_tensors(model, ARCH, torch.float32)}


@pytest.fixture(scope="module")
def weights() -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return ARCH.hf_config("float32"), sharp_weights(0), sharp_weights(1)


@pytest.fixture
def engine(weights):
    config, first, _ = weights
    engine = TorchEngine((config, first), max_running=4, max_len=MAX_LEN, version=1)
    yield engine
    asyncio.run(engine.close())


def lora_updates() -> LoraSpec:
    """The conformance cases' LoRA versions: v10 on sharp_weights(0), with its base, v11 without."""
    return lora_spec(sharp_weights(0), sharp_weights(1), first_version=10)


@pytest.fixture(scope="module")
def lora() -> LoraSpec:
    return lora_updates()


@pytest.fixture
def engine_spec(weights, lora):
    return EngineSpec(vocab_size=ARCH.vocab_size, max_len=MAX_LEN, new_version=2, new_weights=weights[2], lora=lora)


class TestTorchEngineConformance(EngineConformance):
    pass


async def scores(engine: TorchEngine, tokens: torch.Tensor) -> torch.Tensor:
    return torch.tensor([(await engine.score(row.tolist())).token_logprobs for row in tokens])


def publish(tmp_path, name: str, seed: int, version: int = 1, **kwargs):
    arch = get_model(name)
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=seed)
    return model, DirectoryPublisher(tmp_path, arch, dtype="float32", **kwargs).publish(model, version)


@pytest.mark.parametrize("name", ["qwen3-tiny", "minicpm5-tiny"])
@async_case
async def test_score_matches_the_trainers_logprobs(name, tmp_path):
    model, published = publish(tmp_path, name, seed=3)
    engine = TorchEngine(published)
    tokens = torch.randint(0, 512, (3, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = token_logprobs(forward_logits(model, tokens), tokens)
    assert engine.weight_version == published.version == 1
    assert (await scores(engine, tokens) - expected).abs().max().item() <= 1e-5
    await engine.close()


@async_case
async def test_moe_matches_transformers(tmp_path):
    # Compared with HF rather than the trainer: torchtitan's MoE (its own router, grouped-GEMM experts)
    # differs from HF's Qwen3MoeSparseMoeBlock by ~3e-4 in these logits; this engine follows HF.
    from transformers import AutoModelForCausalLM

    _, published = publish(tmp_path, "qwen3-tiny-moe", seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(published.location, dtype=torch.float32)
    tokens = torch.randint(0, 512, (3, 25), generator=torch.Generator().manual_seed(1))
    engine = TorchEngine(published)
    config, tensors = read_published(published)
    with torch.no_grad():
        theirs = hf(tokens[:, :-1]).logits.float()
        ours = load_model(ModelConfig.from_hf(config), tensors, torch.device("cpu"), torch.float32).score_logits(tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5
    expected = token_logprobs(theirs, tokens)
    assert (await scores(engine, tokens) - expected).abs().max().item() <= 1e-5
    await engine.close()


@async_case
async def test_every_source_loads_the_same_model(tmp_path, unique):
    arch = get_model("minicpm5-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=5)
    sharded = DirectoryPublisher(tmp_path, arch, dtype="float32", max_shard_bytes=100_000).publish(model, 1)
    assert (tmp_path / "v000001" / "model.safetensors.index.json").exists()
    publisher = SharedMemoryPublisher(unique("meshy-test"), arch, dtype="float32")
    shared = publisher.publish(model, 2)
    in_memory = (arch.hf_config("float32"), dict(hf_tensors(model, arch, torch.float32)))
    tokens = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = token_logprobs(forward_logits(model, tokens), tokens)
    engines = [TorchEngine(sharded), TorchEngine(shared), TorchEngine(sharded.location), TorchEngine(in_memory)]
    assert [e.weight_version for e in engines] == [1, 2, 0, 0]
    for engine in engines:
        assert (await scores(engine, tokens) - expected).abs().max().item() <= 1e-5
    other, _ = build_model(arch, ParallelConfig(), device="cpu", seed=6)
    await engines[0].update_weights(3, publisher.publish(other, 3))
    with torch.no_grad():
        expected_other = token_logprobs(forward_logits(other, tokens), tokens)
    assert engines[0].weight_version == 3
    assert (await scores(engines[0], tokens) - expected_other).abs().max().item() <= 1e-5
    publisher.close()
    for engine in engines:
        await engine.close()


@async_case
async def test_a_corrupt_or_mismatched_version_leaves_the_old_weights(tmp_path):
    _, first = publish(tmp_path, "qwen3-tiny", seed=7, version=1, keep=3)
    _, second = publish(tmp_path, "qwen3-tiny", seed=8, version=2, keep=3)
    _, moe = publish(tmp_path / "moe", "qwen3-tiny-moe", seed=9, version=3)
    engine = TorchEngine(first)
    tokens = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    before = await scores(engine, tokens)
    shard = tmp_path / "v000002" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptWeights, match="v2 .*checksum mismatch"):
        await engine.update_weights(2, second)
    with pytest.raises(SchemaError, match="version: 4 given for published version 3"):
        await engine.update_weights(4, moe)
    with pytest.raises(SchemaError, match="v3: config.json describes another model"):
        await engine.update_weights(3, moe)
    assert engine.weight_version == 1
    assert torch.equal(await scores(engine, tokens), before)
    await engine.close()


def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def bit_flipped(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x04  # in the tensors' bytes: the header is a few KiB of a 400 KiB file
    return bytes(flipped)


def damage(file, how) -> None:
    file.write_bytes(how(file.read_bytes()))


@pytest.mark.parametrize(
    ("how", "error"),
    [
        (truncated, r"v2: model source .*/model.safetensors: not a readable safetensors file \(.*incomplete metadata"),
        (bit_flipped, r"v2 at .*: checksum"),
    ],
)
@async_case
async def test_a_damaged_published_version_is_refused_whole(tmp_path, how, error):
    _, first = publish(tmp_path, "qwen3-tiny", seed=7, version=1, keep=3)
    _, second = publish(tmp_path, "qwen3-tiny", seed=8, version=2, keep=3)
    damage(tmp_path / "v000002" / "model.safetensors", how)
    with pytest.raises(CorruptWeights, match=error):
        TorchEngine(second)
    engine = TorchEngine(first)
    tokens = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    before, reference = await scores(engine, tokens), await engine.generate("a", prompt(30), greedy(8))
    with pytest.raises(CorruptWeights, match=error):
        await engine.update_weights(2, second)
    assert engine.weight_version == 1
    assert torch.equal(await scores(engine, tokens), before)
    after = await engine.generate("b", prompt(30), greedy(8))
    assert after.output_ids == reference.output_ids and set(after.token_versions) == {1}
    await engine.close()


def garbled_header(data: bytes) -> bytes:
    header = int.from_bytes(data[:8], "little")
    return data[:8] + bytes(b ^ 0x55 for b in data[8 : 8 + header]) + data[8 + header :]


@pytest.mark.parametrize(
    ("file", "how", "error"),
    [
        ("model.safetensors", truncated, "incomplete metadata"),
        ("model.safetensors", lambda data: data[:1000], "invalid header length"),  # cut inside the header
        ("model.safetensors", lambda data: b"", "header too small"),
        ("model.safetensors", garbled_header, "invalid JSON in header"),
        ("model.safetensors", lambda data: (2**40).to_bytes(8, "little") + data[8:], "header too large"),
        ("config.json", truncated, "not valid JSON"),
        ("config.json", lambda data: b"\xff\xfe" + data, "not valid JSON"),
        ("config.json", lambda data: b"[1, 2]", "expected a JSON object, got list"),
    ],
    ids=[
        "truncated",
        "cut-header",
        "empty",
        "garbled-header",
        "huge-header-length",
        "torn-config",
        "binary-config",
        "config-list",
    ],
)
def test_a_damaged_hf_directory_names_the_file(tmp_path, file, how, error):
    _, published = publish(tmp_path, "qwen3-tiny", seed=7)
    directory = Path(published.location)
    damage(directory / file, how)
    for load in (read_model, TorchEngine):
        with pytest.raises(SchemaError, match=f"model source {directory / file}: .*{error}"):
            load(directory)


def test_weights_that_do_not_fit_name_the_tensor(weights):
    config, tensors, _ = weights
    layer = "model.layers.1.mlp.up_proj.weight"
    missing = {k: v for k, v in tensors.items() if k != layer}
    with pytest.raises(SchemaError, match=f"missing tensor {layer}"):
        TorchEngine((config, missing))
    with pytest.raises(SchemaError, match="unexpected tensor model.layers.7.mlp.up_proj.weight"):
        TorchEngine((config, {**tensors, "model.layers.7.mlp.up_proj.weight": tensors[layer]}))
    with pytest.raises(SchemaError, match=rf"tensor {layer} has shape \(128, 63\), expected \(128, 64\)"):
        TorchEngine((config, {**tensors, layer: tensors[layer][:, :63]}))
    with pytest.raises(SchemaError, match="architectures: expected one of"):
        TorchEngine(({**config, "architectures": ["GPT2LMHeadModel"]}, tensors))
    with pytest.raises(SchemaError, match="missing field 'rms_norm_eps'"):
        TorchEngine(({k: v for k, v in config.items() if k != "rms_norm_eps"}, tensors))
    with pytest.raises(SchemaError, match="max_len"):
        TorchEngine((config, tensors), max_len=1)

    too_many = r"max_running x max_len: a KV cache of 65536 requests of 65536 tokens takes [0-9.]+ GiB"
    with pytest.raises(SchemaError, match=too_many + ".*sampling.max_in_flight, sampling.context_length"):
        TorchEngine((config, tensors), max_running=1 << 16, max_len=1 << 16)  # past any host's memory

    @async_case
    async def update_with_a_misshapen_tensor():
        engine = TorchEngine((config, tensors), version=1)
        ids = prompt(20)
        before = await engine.generate("a", ids, greedy(6))
        with pytest.raises(SchemaError, match=layer):
            await engine.update_weights(2, {**tensors, layer: tensors[layer].T})
        after = await engine.generate("b", ids, greedy(6))
        assert engine.weight_version == 1 and after.output_ids == before.output_ids
        await engine.close()

    update_with_a_misshapen_tensor()


@async_case
async def test_eos_from_the_config_stops_int_or_list(weights):
    config, tensors, _ = weights
    engine = TorchEngine(({**config, "eos_token_id": None}, tensors))
    ids = prompt(21)
    reference = await engine.generate("ref", ids, greedy(20))
    await engine.close()
    assert reference.finish_reason == FINISH_LENGTH
    k = max(i for i, token in enumerate(reference.output_ids) if token not in reference.output_ids[:i])
    for eos in (reference.output_ids[k], [0, reference.output_ids[k]]):
        engine = TorchEngine(({**config, "eos_token_id": eos}, tensors))
        stopped = await engine.generate("eos", ids, greedy(20))
        assert stopped.finish_reason == FINISH_STOP and stopped.output_ids == reference.output_ids[: k + 1]
        await engine.close()


@async_case
async def test_requests_wait_for_a_slot_and_a_cancelled_generate_frees_its_own(weights):
    config, tensors, _ = weights
    engine = TorchEngine((config, tensors), max_running=1, max_len=1024)
    with pytest.raises(TimeoutError):  # 1000 tokens take seconds; it is cancelled after 0.05
        await asyncio.wait_for(engine.generate("hog", prompt(22), greedy(1000)), timeout=0.05)
    alone = await asyncio.wait_for(engine.generate("next", prompt(23), SamplingParams(5, seed=1)), timeout=30)
    queued = await asyncio.gather(*(engine.generate(f"q{i}", prompt(23), SamplingParams(5, seed=1)) for i in range(3)))
    assert all(q.output_ids == alone.output_ids for q in queued)
    await engine.close()
    await engine.close()
    with pytest.raises(EngineClosed):
        await engine.generate("closed", prompt(24), greedy(2))


@async_case
async def test_bfloat16_runs_close_to_float32(weights):
    config, tensors, _ = weights
    full, half = TorchEngine((config, tensors)), TorchEngine((config, tensors), dtype="bfloat16")
    tokens = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(5))
    assert 0 < (await scores(half, tokens) - await scores(full, tokens)).abs().max().item() <= 0.25
    result = await half.generate("a", prompt(29), greedy(8))
    assert len(result.output_ids) == len(result.logprobs) >= 1
    for engine in (full, half):
        await engine.close()


@async_case
async def test_a_failing_worker_fails_pending_calls_instead_of_hanging(weights, monkeypatch):
    config, tensors, _ = weights
    engine = TorchEngine((config, tensors), max_len=MAX_LEN)
    await engine.generate("warm", prompt(26), greedy(2))

    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine._scheduler, "decode", broken)
    with pytest.raises(EngineClosed, match="worker failed: RuntimeError\\('device lost'\\)"):
        await asyncio.wait_for(engine.generate("a", prompt(27), greedy(5)), timeout=30)
    with pytest.raises(EngineClosed, match="device lost"):
        await engine.score(prompt(28))
    await asyncio.wait_for(engine.close(), timeout=30)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
class TestCudaTorchEngineConformance(EngineConformance):
    @pytest.fixture
    def engine(self, weights):
        config, first, _ = weights
        engine = TorchEngine((config, first), max_running=4, max_len=MAX_LEN, version=1, device="cuda")
        yield engine
        asyncio.run(engine.close())


@pytest.mark.gpu
@cuda
def test_a_kv_cache_past_the_gpu_s_free_memory_is_refused_before_anything_is_allocated(weights):
    config, tensors, _ = weights
    device = torch.device("cuda")
    free, total = free_bytes(device), torch.cuda.mem_get_info(device)[1]
    assert 0 < free <= total
    allocated = torch.cuda.memory_allocated(device)
    with pytest.raises(SchemaError, match="KV cache of 65536 requests of 65536 tokens"):
        TorchEngine((config, tensors), max_running=1 << 16, max_len=1 << 16, device="cuda")
    assert torch.cuda.memory_allocated(device) == allocated


@pytest.mark.gpu
@cuda
@async_case
async def test_cuda_engine_matches_cpu_replays_graphs_and_release_returns_its_memory(weights):
    config, tensors, _ = weights
    from meshy.dataplane import free_cached

    free_cached(torch.device("cuda"))
    baseline = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    cpu, gpu = TorchEngine((config, tensors)), TorchEngine((config, tensors), device="cuda")
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(4))
    assert (await scores(gpu, tokens) - await scores(cpu, tokens)).abs().max().item() <= 1e-4
    reference = await cpu.generate("a", prompt(25), greedy(MAX_LEN - 25))
    running = asyncio.create_task(gpu.generate("a", prompt(25), greedy(MAX_LEN - 25)))
    for _ in range(1000):  # until the first decode step ran (captured, or failed to)
        if gpu.cuda_graphs["shapes"] or gpu.cuda_graphs["failure"]:
            break
        await asyncio.sleep(0.01)
    held = torch.cuda.memory_allocated() - baseline[0]
    await gpu.release()
    allocated, reserved = torch.cuda.memory_allocated() - baseline[0], torch.cuda.memory_reserved() - baseline[1]
    assert allocated <= 64 << 10 and reserved <= 2 << 20, (
        f"held {held} bytes; after release {allocated} allocated, {reserved} reserved"
    )
    await gpu.onload()
    assert (await running).output_ids == reference.output_ids
    assert gpu.cuda_graphs["failure"] is None and gpu.cuda_graphs["shapes"]
    half = TorchEngine((config, tensors), device="cuda", dtype="bfloat16")
    assert (await scores(half, tokens) - await scores(cpu, tokens)).abs().max().item() <= 0.25
    for engine in (cpu, gpu, half):
        await engine.close()


@pytest.mark.gpu
@cuda
@async_case
async def test_a_compiled_cuda_engine_replays_compiled_decode_graphs_and_generates_what_the_eager_one_does(weights):
    config, tensors, _ = weights
    eager = TorchEngine((config, tensors), max_running=8, max_len=MAX_LEN, device="cuda")
    compiled = TorchEngine((config, tensors), max_running=8, max_len=MAX_LEN, device="cuda", compile=True)
    requests = [(prompt(60 + i)[: 4 + 3 * i], SamplingParams(10 + 6 * i, seed=i)) for i in range(6)]
    runs = []
    for engine in (eager, compiled):
        runs.append(await asyncio.gather(*(engine.generate(f"r{i}", ids, p) for i, (ids, p) in enumerate(requests))))
    for slow, fast in zip(*runs, strict=True):
        assert fast.output_ids == slow.output_ids and fast.logprobs == pytest.approx(slow.logprobs, abs=1e-4)
    assert compiled.compile_failures == []
    assert compiled.cuda_graphs["failure"] is None and compiled.cuda_graphs["shapes"]
    half = TorchEngine((config, tensors), device="cuda", dtype="bfloat16", compile=True)
    assert 1 <= len((await half.generate("h", prompt(70), greedy(12))).output_ids) <= 12
    assert half.compile_failures == []
    for engine in (eager, compiled, half):
        await engine.close()


def test_a_batched_prefill_of_uneven_prompts_matches_the_full_forward_and_decodes_on(weights):
    """Prompts of different lengths prefilled in one padded forward give each one's own logits; the
    padding left in the cache and an idle slot in the decode batch never reach a later decode step."""
    from meshy.infer.torch_model import KVCache

    config, first, _ = weights
    model = load_model(ModelConfig.from_hf(config), first, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, ARCH.vocab_size, (n,), generator=gen) for n in (9, 3, 14)]
    cache = KVCache(model.config, 4, 32, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        prompts = [s[:-2] for s in sequences]
        logits = [model.prefill(prompts, cache, [3, 0, 2])[0]]
        for step in (2, 1):  # decode the last two tokens of each sequence, slot 1 idle
            positions = torch.tensor([len(sequences[1]) - step, 0, len(sequences[2]) - step, len(sequences[0]) - step])
            tokens = torch.stack([sequences[1][-step], torch.tensor(0), sequences[2][-step], sequences[0][-step]])
            hidden, _ = model.decode(tokens, positions, cache, span=32)
            logits.append(model.logits(hidden[[3, 0, 2]]))
        for i, sequence in enumerate(sequences):
            full = model.score_logits(torch.cat([sequence, sequence[:1]])[None])[0]  # logits after each token
            ours = torch.stack([step_logits[i] for step_logits in logits])
            assert (ours - full[-3:]).abs().max().item() <= 1e-4, i


def test_admitted_prompts_are_prefilled_in_runs_of_at_most_prefill_tokens_padded():
    from meshy.infer.torch_engine import PREFILL_TOKENS, _prefill_chunks

    big, mid, over = PREFILL_TOKENS * 5 // 8, PREFILL_TOKENS * 3 // 8, PREFILL_TOKENS + 1
    chunks = _prefill_chunks([big, mid, 100, over, 10, 10], lambda n: n)
    assert chunks == [[big], [mid, 100], [over], [10, 10]]
    assert all(max(c) * len(c) <= PREFILL_TOKENS for c in chunks if len(c) > 1)


@async_case
async def test_requests_that_wait_are_admitted_together_once_a_sixteenth_of_the_slots_are_free(weights, monkeypatch):
    """32 slots, 40 requests finishing one per step: the 8 that wait come in pairs, not one per prefill."""
    assert 32 // ADMISSION_SHARE == 2
    prefilled: list[int] = []
    prefill = DecoderModel.prefill

    def counting(self, sequences, cache, slots):
        prefilled.append(len(sequences))
        return prefill(self, sequences, cache, slots)

    monkeypatch.setattr(DecoderModel, "prefill", counting)
    config, tensors, _ = weights
    engine = TorchEngine(({**config, "eos_token_id": None}, tensors), max_running=32, max_len=MAX_LEN)
    budgets = [3 + i for i in range(40)]
    results = await asyncio.gather(
        *(engine.generate(f"r{i}", prompt(i), SamplingParams(n, seed=i)) for i, n in enumerate(budgets))
    )
    assert [len(r.output_ids) for r in results] == budgets
    assert prefilled == [32, 2, 2, 2, 2]
    lone = await engine.generate("lone", prompt(50), SamplingParams(4, seed=0))  # all fit: admitted at once
    assert len(lone.output_ids) == 4 and prefilled[-1] == 1
    await engine.close()


@async_case
async def test_a_prompt_admitted_several_times_is_prefilled_once_and_each_copy_generates_as_if_alone(
    weights, monkeypatch
):
    """A GRPO group: 4 copies of each of 2 prompts admitted together cost one prefilled row per prompt; each
    copy's cache and draws are those of a request generated alone with its seed."""
    prefilled: list[int] = []
    prefill = DecoderModel.prefill

    def counting(self, sequences, cache, slots):
        prefilled.append(len(sequences))
        return prefill(self, sequences, cache, slots)

    monkeypatch.setattr(DecoderModel, "prefill", counting)
    config, tensors, _ = weights
    config = {**config, "eos_token_id": None}
    together = TorchEngine((config, tensors), max_running=8, max_len=MAX_LEN)
    prompts = [prompt(3)] * 4 + [prompt(5, length=9)] * 4
    grouped = await asyncio.gather(
        *(together.generate(f"r{i}", p, SamplingParams(6, seed=i)) for i, p in enumerate(prompts))
    )
    assert prefilled == [2]
    alone = TorchEngine((config, tensors), max_running=1, max_len=MAX_LEN)
    for i, p in enumerate(prompts):
        lone = await alone.generate(f"lone{i}", p, SamplingParams(6, seed=i))
        assert grouped[i].output_ids == lone.output_ids, i
        assert grouped[i].logprobs == pytest.approx(lone.logprobs, abs=1e-4), i
    assert len({tuple(g.output_ids) for g in grouped[:4]}) > 1, "each copy draws with its own seed"
    for engine in (together, alone):
        await engine.close()


def test_the_slots_state_on_the_device_is_what_each_running_request_feeds_and_draws_next(weights):
    """After every step, through admission, finishing, slot reuse, abort, release and onload: each held
    slot's device state is its request's last token at its next position, drawing its next token with
    its seed and settings; every other slot is idle at position 0."""
    config, tensors, _ = weights
    model_config = ModelConfig.from_hf({**config, "eos_token_id": None})
    model = load_model(model_config, tensors, torch.device("cpu"), torch.float32)
    scheduler = _Scheduler(model, model_config, 4, MAX_LEN, torch.device("cpu"), torch.float32, 0)
    settings = [SamplingParams(9, temperature=0.7, top_p=0.9, seed=(1 << 63) + 5), SamplingParams(3, seed=7)]
    settings += [SamplingParams(2 + i, top_k=5, seed=i) for i in range(4)] + [greedy(6)]
    requests = [_Request(f"r{i}", prompt(i + 3), p, frozenset(), Future()) for i, p in enumerate(settings)]
    for request in requests:
        scheduler.apply(request)

    def check() -> None:
        scheduler.slots.flush()
        ints, floats = scheduler.slots.ints.tolist(), scheduler.slots.settings.tolist()
        for slot in range(4):
            request = scheduler.running.get(slot)
            if request is None:
                assert ints[HELD][slot] == ints[POSITION][slot] == 0
                continue
            p = request.params
            assert [row[slot] for row in ints] == [
                request.output[-1],
                request.cached,
                request.seed,
                len(request.output),
                1,
            ]
            expected = torch.tensor([p.temperature, p.top_k or model_config.vocab_size, p.top_p]).tolist()
            assert [row[slot] for row in floats] == expected

    steps = 0
    while scheduler.running or scheduler.waiting:
        scheduler.step()
        check()
        steps += 1
        if steps == 2:
            scheduler.abort("r0")
            check()
        if steps == 3:
            scheduler.release()
            scheduler.onload()
            check()
    assert [len(r.done.result().output_ids) for r in requests[1:]] == [p.max_new_tokens for p in settings[1:]]
    assert requests[0].done.result().finish_reason == FINISH_ABORT


@pytest.mark.slow  # compiling the decode and the sampler takes about a minute on 2 cores
@async_case
async def test_a_compiled_engine_generates_what_the_eager_one_does(weights):
    config, tensors, _ = weights
    eager = TorchEngine((config, tensors), max_running=8, max_len=MAX_LEN)
    compiled = TorchEngine((config, tensors), max_running=8, max_len=MAX_LEN, compile=True)
    requests = [
        (prompt(40 + i)[: 5 + 3 * i], SamplingParams(12 + 5 * i, seed=i, top_k=50 if i % 2 else 0)) for i in range(6)
    ]
    runs = []
    for engine in (eager, compiled):  # continuous batching: the six finish at different steps
        runs.append(await asyncio.gather(*(engine.generate(f"r{i}", ids, p) for i, (ids, p) in enumerate(requests))))
    for slow, fast in zip(*runs, strict=True):
        assert fast.output_ids == slow.output_ids and fast.finish_reason == slow.finish_reason
        assert fast.logprobs == pytest.approx(slow.logprobs, abs=1e-5)
    assert compiled.compile_failures == []
    for engine in (eager, compiled):
        await engine.close()


COMPILE_WITHOUT_CXX = """
import asyncio, json, torch
from meshy.infer.engine import SamplingParams
from meshy.infer.torch_engine import ADMISSION_SHARE, TorchEngine
from tests.infer.test_torch_engine import ARCH, MAX_LEN, prompt, sharp_weights

async def main():
    weights = (ARCH.hf_config("float32"), sharp_weights(0))
    eager, compiled = TorchEngine(weights, max_len=MAX_LEN), TorchEngine(weights, max_len=MAX_LEN, compile=True)
    runs = [await e.generate("a", prompt(50), SamplingParams(9, seed=3)) for e in (eager, compiled)]
    print(json.dumps([[r.output_ids, r.logprobs] for r in runs] + [compiled.compile_failures]))
    for e in (eager, compiled):
        await e.close()

asyncio.run(main())
"""


@pytest.mark.slow
def test_a_compiled_engine_on_a_host_without_a_cxx_compiler_runs_eagerly_and_says_why(tmp_path):
    """A CPU host without g++ (a laptop): inductor finds no compiler (CXX names none that exists)."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_WITHOUT_CXX], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (eager_ids, eager_logprobs), (ids, logprobs), failures = json.loads(result.stdout.splitlines()[-1])
    assert ids == eager_ids and logprobs == pytest.approx(eager_logprobs, abs=1e-6)
    assert {f.split(" failed")[0] for f in failures} == {"torch.compile of decode", "torch.compile of sample"}
    assert all("no-such-compiler" in f for f in failures), failures


EVERY_PROJECTION = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def adapted_model(name: str, seed: int) -> torch.nn.Module:
    """The trainer's model with adapters on every projection, B nonzero (new adapters change nothing)."""
    lora = LoraConfig(rank=4, alpha=8.0, targets=EVERY_PROJECTION)
    model, _ = build_model(get_model(name), ParallelConfig(), device="cpu", seed=seed, lora=lora)
    nudge_adapters(model, seed)
    return model


def nudge_adapters(model: torch.nn.Module, seed: int) -> None:
    """New values for every lora_B, as a training step would give them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def trainer_logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(forward_logits(model, tokens), tokens)


@pytest.mark.parametrize("name", ["qwen3-tiny", "minicpm5-tiny"])
@async_case
async def test_lora_versions_score_the_trainers_logprobs_and_update_without_the_base(name, tmp_path):
    """In float32, as exact as whole versions (1e-5): the engine built from the first LoRA version (base and
    adapters), then updated with adapter-only versions, published and in memory (as received)."""
    model = adapted_model(name, seed=3)
    publisher = DirectoryPublisher(tmp_path, get_model(name), dtype="float32", keep=4)
    first = publisher.publish(model, 1)
    assert first.adapter is not None and first.adapter.rank == 4
    engine = TorchEngine(first)
    assert engine.lora_base == first.adapter.base
    tokens = torch.randint(0, 512, (3, 33), generator=torch.Generator().manual_seed(0))
    assert (await scores(engine, tokens) - trainer_logprobs(model, tokens)).abs().max().item() <= 1e-5
    shutil.rmtree(first.location)  # as the eval role discards each version it evaluated: the base stays
    for version in (2, 3):
        nudge_adapters(model, seed=version)
        published = publisher.publish(model, version)
        source = published if version == 2 else dict(adapter_tensors(model))
        await engine.update_weights(version, source, None if version == 2 else published.adapter)
        assert engine.weight_version == version and engine.lora_base == first.adapter.base
        assert (await scores(engine, tokens) - trainer_logprobs(model, tokens)).abs().max().item() <= 1e-5
    await engine.close()


@async_case
async def test_lora_in_bfloat16_stays_as_close_to_the_trainer_as_whole_versions(tmp_path):
    """bfloat16 engines against the float32 trainer: a LoRA version (base and adapters published in bfloat16,
    merged by the engine) is no further from the trainer than the same model published whole (merged by
    the trainer) and loaded in bfloat16, give or take bfloat16's rounding, and within 0.02 in logprob
    (measured: 3.1e-3, and 2.5e-3 whole)."""
    model = adapted_model("qwen3-tiny", seed=4)
    arch = get_model("qwen3-tiny")
    lora = DirectoryPublisher(tmp_path / "lora", arch, dtype="bfloat16").publish(model, 1)
    whole = DirectoryPublisher(tmp_path / "whole", arch, dtype="bfloat16", adapters=False).publish(model, 1)
    assert lora.adapter is not None and whole.adapter is None
    tokens = torch.randint(0, 512, (3, 33), generator=torch.Generator().manual_seed(1))
    expected = trainer_logprobs(model, tokens)
    errors = []
    for published in (lora, whole):
        engine = TorchEngine(published, dtype="bfloat16")
        errors.append((await scores(engine, tokens) - expected).abs().max().item())
        await engine.close()
    assert 0 < errors[0] <= 0.02 and errors[0] <= 2 * errors[1], errors


@async_case
async def test_lora_sources_that_do_not_fit_are_refused_and_change_nothing(weights, lora):
    config, _, _ = weights
    first, only = lora.with_base, lora.adapters_only
    with pytest.raises(SchemaError, match="a LoRA version without its base"):
        TorchEngine((config, only.source), adapter=only.adapter)
    with pytest.raises(SchemaError, match="unexpected tensor base_model.model.model.layers"):
        TorchEngine((config, first.source))  # adapters, but no Adapter to say how they apply
    engine = TorchEngine((config, first.source), adapter=first.adapter, version=first.version)
    assert engine.lora_base == first.adapter.base
    ids = prompt(31)
    before = await engine.generate("a", ids, greedy(6))
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    a_name, b_name = adapter_names(q_proj)
    embed_a, embed_b = adapter_names("model.embed_tokens.weight")
    for source, error in [
        ({**only.source, b_name: only.source[b_name][:-1]}, rf"adapters for {q_proj}: A \(4, 64\) and B \(63, 4\)"),
        ({**only.source, embed_a: torch.ones(4, 64), embed_b: torch.ones(512, 4)}, "no such projection"),
        ({k: v for k, v in only.source.items() if k != a_name}, f"{b_name}.*lora_A half is missing"),
    ]:
        with pytest.raises(SchemaError, match=error):
            await engine.update_weights(only.version, source, only.adapter)
    after = await engine.generate("b", ids, greedy(6))
    assert engine.weight_version == first.version and after.output_ids == before.output_ids
    assert after.logprobs == pytest.approx(before.logprobs, abs=1e-6)
    await engine.close()


@async_case
async def test_a_published_lora_version_s_adapter_is_its_own(tmp_path):
    model = adapted_model("qwen3-tiny", seed=5)
    published = DirectoryPublisher(tmp_path, get_model("qwen3-tiny"), dtype="float32").publish(model, 1)
    other = dataclasses.replace(published.adapter, rank=8)
    with pytest.raises(SchemaError, match="adapter: .* given for published version 1, which has"):
        TorchEngine(published, adapter=other)
    engine = TorchEngine(published)
    with pytest.raises(SchemaError, match="adapter: .* given for published version 1, which has"):
        await engine.update_weights(1, published, other)
    await engine.close()
