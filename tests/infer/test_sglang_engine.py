"""SGLangEngine against the engine conformance cases and SGLang-specific checks (`pytest -m sglang`).

On a machine without CUDA it runs SGLang's CPU path: SGLANG_USE_CPU_ENGINE=1, attention_backend
"torch_native", float32, with the test stand-in for sgl_kernel (tests/infer/sglang_stub) first on the
path of this process and of every process SGLang spawns. One engine serves the whole module (a start
costs 20-60 s): after each case it is resumed, onloaded and put back on weights version 1; a case that
closes it gets a new one for the next.
"""

import asyncio
import dataclasses
import importlib.util
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from meshy.dataplane import SchemaError, WeightSyncError
from meshy.dataplane.adapters import Adapter
from meshy.dataplane.weight_sync import WeightSyncGroup
from meshy.dataplane.weights import CorruptWeights, Published, Transport, read_published, tensors_checksum
from meshy.infer.engine import FINISH_ABORT
from meshy.infer.torch_engine import TorchEngine
from meshy.train.logprobs import forward_logits, token_logprobs
from meshy.train.lora import adapter_tensors, apply_lora
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.publish import CollectivePublisher, DirectoryPublisher, SharedMemoryPublisher
from meshy.train.training_config import LoraConfig, ParallelConfig
from tests.infer.conformance import EngineConformance, EngineSpec, async_case, greedy, probe, prompt

pytestmark = pytest.mark.sglang

ARCH = get_model("qwen3-tiny")
MAX_LEN = 96
ON_CPU = not torch.cuda.is_available()
STUB = Path(__file__).parent / "sglang_stub"
# A small pool: SGLang sizes its KV cache from free memory otherwise (most of the host's RAM on CPU).
# max_total_tokens caps it; mem_fraction_static stays SGLang's own, because SGLang fails to start (and
# SIGKILLs its host process) when free memory falls by more than 1 - mem_fraction_static of what it was
# while it loads the weights: at 0.05, any other process taking 5% meanwhile did (a CI run, beside
# another test suite). No radix cache: a request reusing a cached prompt's KV gets logprobs ~1e-7 off
# those of the same request computed whole, and the conformance cases compare repeated greedy logprobs
# exactly.
SERVER_ARGS = {"max_total_tokens": 8192, "disable_radix_cache": True}
# Takes 3 GiB, gives it back, again and again: what the rest of a test suite does beside this one.
MEMORY_CHURN = """
import time
end = time.monotonic() + 120
while time.monotonic() < end:
    taken = bytearray(3 << 30)
    time.sleep(0.5)
    del taken
    time.sleep(0.5)
"""
NO_SEEDS = (
    "SGLang 0.5.23 honours sampling_seed only with enable_deterministic_inference, which rejects "
    "attention_backend torch_native (the only CPU backend) and samples with a Triton kernel"
)


def sharp_model(seed: int) -> torch.nn.Module:
    """qwen3-tiny with every matrix scaled 8x: the weights of test_torch_engine.sharp_weights, as a model
    a publisher can write (greedy output that is not degenerate)."""
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 2:
                parameter.mul_(8)
    return model


class Started(Exception):
    """What the stand-in for sglang.Engine (replace_sglang_engine) raises once it has its arguments."""


def replace_sglang_engine(monkeypatch, on_start: Callable[..., None]) -> None:
    """sglang.Engine replaced by a stand-in that calls on_start(**arguments) and raises Started: it runs
    where sglang.Engine would, inside SGLangEngine's environment for the start."""
    use_stub_kernels()
    import sglang

    def engine(**kwargs):
        on_start(**kwargs)
        raise Started

    monkeypatch.setattr(sglang, "Engine", engine)


def use_stub_kernels() -> None:
    """The sgl_kernel stand-in, first on the path here and in SGLang's children (set before sglang is
    imported). Only where CUDA is missing: a GPU machine uses the real kernels."""
    if ON_CPU and str(STUB) not in sys.path:
        sys.path.insert(0, str(STUB))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUB), os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Published, Published]:
    publisher = DirectoryPublisher(tmp_path_factory.mktemp("weights"), ARCH, dtype="float32", keep=10)
    return publisher.publish(sharp_model(0), 1), publisher.publish(sharp_model(1), 2)


def start_engine(source, **kwargs):
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (uv sync --extra sglang)")
    use_stub_kernels()
    from meshy.infer.sglang_engine import SGLangEngine

    # On a GPU (not run so far): seeds and release need deterministic inference and the memory saver;
    # float32 on Triton attention keeps the conformance tolerances.
    on_gpu = dict(device="cuda", attention_backend="triton", deterministic=True, colocate=True)
    device = dict(device="cpu") if ON_CPU else on_gpu
    return SGLangEngine(source, dtype="float32", max_len=MAX_LEN, max_running=16, **device, **SERVER_ARGS, **kwargs)


@pytest.fixture(scope="module")
def shared(published):
    """The module's one engine, in a list so a case that closes it can be followed by a new one."""
    holder = []
    yield holder
    for engine in holder:
        asyncio.run(engine.close())


async def back_to_start(engine, first: Published) -> None:
    engine.pause_mode, engine.bucket_bytes = "retract", 1 << 30
    await engine.resume()
    await engine.onload()
    if engine.weight_version != first.version:
        await engine.update_weights(first.version, first)


@pytest.fixture
def engine(shared, published):
    if not shared or shared[-1].closed:
        shared.append(start_engine(published[0]))
    yield shared[-1]
    if not shared[-1].closed:
        asyncio.run(back_to_start(shared[-1], published[0]))


@pytest.fixture(scope="module")
def new_tensors(published) -> dict[str, torch.Tensor]:
    return read_published(published[1])[1]


@pytest.fixture
def engine_spec(new_tensors):
    return EngineSpec(vocab_size=ARCH.vocab_size, max_len=MAX_LEN, new_version=2, new_weights=new_tensors)


@async_case
async def test_greedy_batched_results_equal_single_results(engine):
    """The greedy half of the batching case, which the CPU tier cannot run whole (no seeds)."""
    prompts = [prompt(40 + i, length=3 + i) for i in range(8)]
    alone = [await engine.generate(f"alone{i}", p, greedy(10 + i)) for i, p in enumerate(prompts)]
    batched = await asyncio.gather(*(engine.generate(f"batched{i}", p, greedy(10 + i)) for i, p in enumerate(prompts)))
    for one, many in zip(alone, batched, strict=True):
        assert many.output_ids == one.output_ids and many.finish_reason == one.finish_reason
        assert many.logprobs == pytest.approx(one.logprobs, abs=1e-5)


@async_case
async def test_matches_the_reference_engine(engine, published):
    reference = TorchEngine(published[0], max_len=MAX_LEN)
    ids = prompt(41)
    ours, theirs = await engine.generate("a", ids, greedy(24)), await reference.generate("a", ids, greedy(24))
    assert ours.output_ids == theirs.output_ids
    assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)
    sequence = ids + theirs.output_ids
    ours, theirs = await engine.score(sequence, top_k=5, start=2), await reference.score(sequence, top_k=5, start=2)
    assert ours.token_logprobs == pytest.approx(theirs.token_logprobs, abs=1e-4)
    assert ours.topk_ids == theirs.topk_ids
    await reference.close()


@async_case
async def test_update_from_a_published_directory_is_verified(engine, published, tmp_path, new_tensors):
    first, second = published
    ids = prompt(42)
    before = await engine.generate("before", ids, greedy(16))
    engine.bucket_bytes = 64 << 10  # the model's 430 kB in 7 buckets, one SGLang call each
    await engine.update_weights(second.version, new_tensors)
    from_memory = await engine.generate("memory", ids, greedy(16))
    await engine.update_weights(first.version, first)
    assert (await engine.generate("back", ids, greedy(16))).output_ids == before.output_ids

    await engine.update_weights(second.version, second)
    from_disk = await engine.generate("disk", ids, greedy(16))
    assert engine.weight_version == 2 and from_disk.token_versions == [2] * 16
    assert from_disk.output_ids == from_memory.output_ids != before.output_ids

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_bytes((Path(first.location) / "config.json").read_bytes())
    data = bytearray((Path(first.location) / "model.safetensors").read_bytes())
    data[-5] ^= 0xFF
    (corrupt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CorruptWeights, match="v3 .*checksum mismatch"):
        await engine.update_weights(3, Published(3, first.transport, str(corrupt), first.checksum, 0, 0.0))
    with pytest.raises(SchemaError, match="version: 4 given for published version 2"):
        await engine.update_weights(4, second)
    layer = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(SchemaError, match=rf"tensor {layer} has shape \(64, 128\), expected \(128, 64\)"):
        await engine.update_weights(5, {**new_tensors, layer: new_tensors[layer].T})
    with pytest.raises(SchemaError, match=f"missing tensor {layer}"):
        await engine.update_weights(5, {k: v for k, v in new_tensors.items() if k != layer})
    assert engine.weight_version == 2
    assert (await engine.generate("still", ids, greedy(16))).output_ids == from_disk.output_ids


@async_case
async def test_update_from_shared_memory(engine, unique):
    publisher = SharedMemoryPublisher(unique("meshy-sglang-test"), ARCH, dtype="float32")
    try:
        await engine.update_weights(7, publisher.publish(sharp_model(1), 7))
        result = await engine.generate("shm", prompt(43), greedy(8))
        assert engine.weight_version == 7 and result.token_versions == [7] * 8
    finally:
        publisher.close()


@async_case
async def test_abort_mode_pause_resubmits_from_the_prefix(engine, new_tensors):
    ids = prompt(44)
    budget = MAX_LEN - len(ids)
    reference = await engine.generate("ref", ids, greedy(budget))
    engine.pause_mode = "abort"
    task = asyncio.create_task(engine.generate("long", ids, greedy(budget)))
    await probe(engine)
    await engine.pause()
    await engine.update_weights(2, new_tensors)
    await engine.resume()
    result = await task
    switch, produced = result.token_versions.index(2), len(result.output_ids)
    assert 0 < switch < produced and result.token_versions == [1] * switch + [2] * (produced - switch)
    assert len(result.logprobs) == produced
    assert result.output_ids[:switch] == reference.output_ids[:switch]
    # the rest as the new weights alone produce it from the prefix (to the budget, or to EOS if they reach it)
    after = await engine.generate("after", ids + result.output_ids[:switch], greedy(budget - switch))
    assert result.output_ids[switch:] == after.output_ids and result.finish_reason == after.finish_reason


@async_case
async def test_abort_while_paused_returns_the_partial_output(engine):
    """What the inference service does to load weights: pause, abort what runs (each abort returns the
    tokens produced so far, though SGLang holds the request retracted in its queue), resume."""
    ids = prompt(45)
    budget = MAX_LEN - len(ids)
    task = asyncio.create_task(engine.generate("long", ids, greedy(budget)))
    await probe(engine)
    await engine.pause()
    await engine.abort("long")
    aborted = await asyncio.wait_for(task, timeout=30)
    await engine.resume()
    assert aborted.finish_reason == FINISH_ABORT and 1 <= len(aborted.output_ids) < budget


@async_case
async def test_a_multi_turn_trajectory_continues_from_its_exact_token_prefix_as_on_the_reference_engine(
    engine, published
):
    """The same greedy trajectory (policy turns, then the template's observation ids, then the next turn
    from the whole sequence) on SGLang and on TorchEngine: the same tokens, mask and versions."""
    from meshy.recipes.agents.trajectory import AgentLimits, run_trajectory
    from tests.recipes.test_agent_trajectory import TOKENIZER, Echo

    reference = TorchEngine(published[0], max_len=MAX_LEN)
    stops = tuple(range(0, ARCH.vocab_size, 3))  # short turns: a sharp random model rarely ends its own
    limits = AgentLimits(max_turns=3, max_tokens=MAX_LEN - 22, deadline_s=120)
    played = []
    for policy in (engine, reference):
        inputs = []

        async def generate(ids, max_new_tokens, policy=policy, inputs=inputs):
            inputs.append(list(ids))
            return await policy.generate(f"turn{len(inputs)}", ids, greedy(max_new_tokens, stop_token_ids=stops))

        played.append((await run_trajectory(Echo(), "hi", generate, TOKENIZER, "qwen3", limits), inputs))
    await reference.close()
    (ours, our_inputs), (theirs, their_inputs) = played
    assert ours.turns >= 2 and our_inputs == their_inputs
    assert (ours.response_ids, ours.policy_mask, ours.token_versions) == (
        theirs.response_ids,
        theirs.policy_mask,
        theirs.token_versions,
    )
    assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)
    assert our_inputs[1] == ours.prompt_ids + ours.response_ids[: len(our_inputs[1]) - len(ours.prompt_ids)]


def test_buckets_hold_each_tensor_once_in_order_within_the_size(new_tensors):
    from meshy.infer.sglang_engine import bucket_names

    sizes = {name: t.numel() * t.element_size() for name, t in new_tensors.items()}
    buckets = bucket_names(new_tensors, 64 << 10)
    assert len(buckets) > 1 and [name for bucket in buckets for name in bucket] == list(new_tensors)
    assert all(sum(sizes[name] for name in bucket) <= 64 << 10 or len(bucket) == 1 for bucket in buckets)
    assert bucket_names(new_tensors, 1 << 30) == [list(new_tensors)]


def test_settings_sglang_cannot_run_are_refused_before_it_starts(published, unique):
    from meshy.infer.sglang_engine import SGLangEngine

    with pytest.raises(SchemaError, match="deterministic=True needs a GPU"):
        SGLangEngine(published[0], device="cpu", deterministic=True)
    with pytest.raises(SchemaError, match="pause_mode"):
        SGLangEngine(published[0], device="cpu", pause_mode="in_place")
    with pytest.raises(SchemaError, match="context_length: set by SGLangEngine \\(through max_len\\)"):
        SGLangEngine(published[0], device="cpu", context_length=2048)
    publisher = SharedMemoryPublisher(unique("meshy-sglang-test"), ARCH, dtype="float32")
    try:
        with pytest.raises(SchemaError, match="cannot start an engine"):
            SGLangEngine(publisher.publish(sharp_model(0), 1), device="cpu")
    finally:
        publisher.close()


def test_on_the_cpu_the_kv_cache_holds_max_running_requests_of_max_len(published, monkeypatch):
    """Not most of the free host memory, which SGLang takes by default: a recipe run with one engine went
    from 4 to 16 GiB used of 23 as the engine started."""
    started = {}
    replace_sglang_engine(monkeypatch, started.update)
    from meshy.infer.sglang_engine import SGLangEngine

    with pytest.raises(Started):
        SGLangEngine(published[0], device="cpu", max_running=8, max_len=40)
    assert started["max_total_tokens"] == 8 * started["context_length"] and started["context_length"] >= 40
    with pytest.raises(Started):
        SGLangEngine(published[0], device="cpu", max_running=8, max_len=40, max_total_tokens=1000)
    assert started["max_total_tokens"] == 1000, "an explicit size wins"


def test_max_len_may_take_every_position_of_the_model_and_no_more(published, monkeypatch):
    """SGLang caps a request a few tokens short of its context length, so the engine starts it with a few
    more than max_len; at the model's whole context that is past what SGLang allows by default. The
    default recipe's context_length is the tiny model's 512 positions (a real start: the SGLang fault tests)."""
    allowed = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"
    monkeypatch.delenv(allowed, raising=False)
    started = {}
    replace_sglang_engine(monkeypatch, lambda **kwargs: started.update(kwargs, allowed=os.environ.get(allowed)))
    from meshy.infer.sglang_engine import SGLangEngine

    positions = ARCH.max_position_embeddings
    with pytest.raises(Started):
        SGLangEngine(published[0], device="cpu", max_running=8, max_len=positions)
    assert started["context_length"] > positions and started["allowed"] == "1"
    assert allowed not in os.environ, "allowed while SGLang starts (its processes inherit it), then put back"
    with pytest.raises(Started):
        SGLangEngine(published[0], device="cpu", max_running=8, max_len=positions - 64)
    assert started["context_length"] <= positions and started["allowed"] is None
    with pytest.raises(SchemaError, match=f"max_len: expected at most the model's context length \\({positions}"):
        SGLangEngine(published[0], device="cpu", max_running=8, max_len=positions + 1)


def test_the_engine_starts_while_another_process_takes_and_gives_back_memory(shared, published):
    for engine in shared:  # one SGLang engine per process at a time: this one becomes the module's
        if not engine.closed:
            asyncio.run(engine.close())
    churn = subprocess.Popen([sys.executable, "-c", MEMORY_CHURN])
    try:
        time.sleep(1.0)  # churning before SGLang measures free memory, and while it loads the weights
        shared.append(start_engine(published[0]))
    finally:
        churn.kill()
        churn.wait()
    generated = asyncio.run(shared[-1].generate("after-start", prompt(0), greedy(4)))
    assert 1 <= len(generated.output_ids) <= 4


TORN, UNSENT = 6, 7  # broadcast with a checksum its tensors do not have; announced by a publisher that died


def publish_then_die(announced) -> None:
    """A trainer hosting the weight-sync group (a process of its own): v3 whole, v4 and v5 as deltas, v6
    torn, then it announces v7 and dies before broadcasting it."""
    no_resync = SimpleNamespace(read=lambda max_n: [])  # no engine asks for a whole version here

    def announce(_, message: dict) -> None:
        announced.put({**message, "checksum": "0" * 32} if message["version"] == TORN else message)

    hosting = WeightSyncGroup.hosting("127.0.0.1", size=2, name="meshy-weights", timeout_s=300)
    stream = SimpleNamespace(append=announce, reader=lambda *_, **__: no_resync)
    publisher = CollectivePublisher(hosting, ARCH, stream, dtype="float32", delta=True, full_every=100)
    for version, seed in ((3, 0), (4, 1), (5, 0), (TORN, 1)):
        publisher.publish(sharp_model(seed), version)

    def die(*_) -> None:  # once v7 is announced (flushed to the queue), before any of it is sent
        announced.close()
        announced.join_thread()
        os._exit(0)

    hosting.send = die
    publisher.publish(sharp_model(0), UNSENT)


def test_an_engine_receives_broadcast_versions_in_sglang_and_keeps_serving_when_one_fails_or_never_comes(
    shared, published
):
    """What the inference role does with publish = "collective": the engine starts from the first
    version's announcement, its scheduler joins the weight-sync group where the announcement says (SGLang's
    own update group, which the publisher hosts) and receives every version there, whole or as a delta;
    each serves what a reference engine serves from the same weights on disk. A version whose checksum does
    not match, or whose publisher dies before sending it, is not loaded at all: the engine goes on serving
    the one before."""
    for engine in shared:  # one SGLang engine per process at a time: this one becomes the module's
        if not engine.closed:
            asyncio.run(engine.close())
    context = multiprocessing.get_context("spawn")
    announced = context.Queue()
    trainer = context.Process(target=publish_then_die, args=(announced,))
    trainer.start()
    first = Published.from_message(announced.get(timeout=300))
    assert "delta" not in json.loads(first.location) and json.loads(first.location)["rendezvous"]["port"] > 0
    shared.append(start_engine(first, weight_sync_rank=1))
    engine = shared[-1]

    async def serves(version: int, same_weights: Published) -> None:
        assert engine.weight_version == version
        reference = TorchEngine(same_weights, max_len=MAX_LEN)
        ids = prompt(45)
        ours, theirs = await engine.generate("bc", ids, greedy(16)), await reference.generate("bc", ids, greedy(16))
        assert ours.output_ids == theirs.output_ids and ours.token_versions == [version] * 16
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)
        await reference.close()

    try:
        asyncio.run(serves(3, published[0]))  # sharp_model(0)'s weights
        for version, same_weights in ((4, published[1]), (5, published[0])):
            update = Published.from_message(announced.get(timeout=300))
            assert json.loads(update.location)["delta"]["base"] == version - 1, "a delta on the version before"
            asyncio.run(engine.update_weights(version, update))
            asyncio.run(serves(version, same_weights))
        with pytest.raises(CorruptWeights, match=f"v{TORN}"):
            asyncio.run(engine.update_weights(TORN, Published.from_message(announced.get(timeout=300))))
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match=f"v{UNSENT}"):
            asyncio.run(engine.update_weights(UNSENT, Published.from_message(announced.get(timeout=300))))
        assert time.monotonic() - started < 60, "the publisher's death ends the receive, not a timeout"
        asyncio.run(serves(5, published[0]))  # still v5: nothing of v6 or v7 was loaded
    finally:
        trainer.join(60)
        trainer.kill()
    asyncio.run(back_to_start(engine, published[0]))


@async_case
async def test_an_engine_started_from_a_whole_model_refuses_lora_versions(engine, new_tensors):
    adapter = Adapter(8, 16.0, ("q_proj",), "0" * 32)
    with pytest.raises(SchemaError, match="v5 adapter: a LoRA version .* SGLang enables LoRA only at start"):
        await engine.update_weights(5, new_tensors, adapter=adapter)
    assert engine.weight_version == 1


def test_importing_the_engine_module_does_not_import_sglang():
    code = "import sys, meshy.infer.sglang_engine; assert 'sglang' not in sys.modules, 'sglang was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# Last: its close case ends the module's engine.
class TestSGLangEngineConformance(EngineConformance):
    @pytest.mark.xfail(ON_CPU, reason=NO_SEEDS, strict=True)
    def test_same_seed_same_tokens_other_seed_other_tokens(self, engine, engine_spec):
        super().test_same_seed_same_tokens_other_seed_other_tokens(engine, engine_spec)

    @pytest.mark.xfail(ON_CPU, reason=f"its sampled requests are seeded: {NO_SEEDS}", strict=True)
    def test_batched_results_equal_single_results(self, engine, engine_spec):
        super().test_batched_results_equal_single_results(engine, engine_spec)

    def test_close_ends_pending_generations_as_aborted(self, engine, engine_spec):
        """Also: close stops SGLang's processes and no other child of this process."""
        import psutil  # SGLang's dependency: this module is collected without it

        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        try:
            others = {p.pid for p in psutil.Process().children(recursive=True)} - {bystander.pid}
            super().test_close_ends_pending_generations_as_aborted(engine, engine_spec)
            assert bystander.poll() is None, "close killed a child process that is not SGLang's"
            survivors = [p for p in psutil.Process().children(recursive=True) if p.pid in others]
            assert all("resource_tracker" in " ".join(p.cmdline()) for p in survivors), survivors
        finally:
            bystander.kill()
            bystander.wait()


MOE = get_model("qwen3-tiny-moe")


@pytest.fixture(scope="module")
def published_moe(tmp_path_factory) -> tuple[Published, Published]:
    """Two versions of qwen3-tiny-moe with every matrix scaled 4x: routers far from uniform, so numerics
    alone choose no other expert."""
    publisher = DirectoryPublisher(tmp_path_factory.mktemp("moe-weights"), MOE, dtype="float32", keep=10)
    versions = []
    for seed in (0, 1):
        model, _ = build_model(MOE, ParallelConfig(), device="cpu", seed=seed)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.ndim >= 2:
                    parameter.mul_(4)
        versions.append(publisher.publish(model, seed + 1))
    return versions[0], versions[1]


def same_experts(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """The same experts per token and layer (the order of the top k is not part of the routing)."""
    return ours.dtype == theirs.dtype == torch.int16 and torch.equal(ours.sort(-1).values, theirs.sort(-1).values)


def test_settings_routing_needs_are_refused_before_sglang_starts(published, published_moe):
    from meshy.infer.sglang_engine import SGLangEngine

    with pytest.raises(SchemaError, match='pause_mode: expected "abort" with record_routing=True'):
        SGLangEngine(published_moe[0], device="cpu", record_routing=True)
    with pytest.raises(SchemaError, match="record_routing: the model is dense"):
        SGLangEngine(published[0], device="cpu", record_routing=True, pause_mode="abort")
    with pytest.raises(SchemaError, match="enable_return_routed_experts: set by SGLangEngine"):
        SGLangEngine(published_moe[0], device="cpu", enable_return_routed_experts=True)


def test_a_mixture_s_routing_is_recorded_as_on_the_reference_engine_and_spliced_across_a_pause(shared, published_moe):
    """Routing replay's input from SGLang: the experts of every output token, as TorchEngine records them
    for the same tokens; across an abort-mode pause with a weight update, the first request's experts
    (old weights) followed by the continuation's (new weights)."""
    for engine in shared:  # one SGLang engine per process at a time
        if not engine.closed:
            asyncio.run(engine.close())
    engine = start_engine(published_moe[0], record_routing=True, pause_mode="abort")

    async def check() -> None:
        old, new = TorchEngine(published_moe[0], max_len=MAX_LEN), TorchEngine(published_moe[1], max_len=MAX_LEN)
        assert engine.records_routing and old.records_routing
        for seed in range(3):
            ids = prompt(seed, vocab_size=MOE.vocab_size)
            ours, theirs = await engine.generate(f"g{seed}", ids, greedy(24)), await old.generate("g", ids, greedy(24))
            assert ours.output_ids == theirs.output_ids
            assert ours.routed_experts.shape == (len(ours.output_ids), MOE.num_hidden_layers, MOE.num_experts_per_tok)
            assert same_experts(ours.routed_experts, theirs.routed_experts)

        ids = prompt(7, vocab_size=MOE.vocab_size)
        budget = MAX_LEN - len(ids)
        task = asyncio.create_task(engine.generate("long", ids, greedy(budget)))
        await probe(engine)
        await engine.pause()
        await engine.update_weights(2, published_moe[1])
        await engine.resume()
        result = await task
        switch = result.token_versions.index(2) if 2 in result.token_versions else 0
        assert 0 < switch < len(result.output_ids), "the pause did not split the request"
        before = await old.generate("before", ids, greedy(switch))
        rest = len(result.output_ids) - switch
        after = await new.generate("after", ids + result.output_ids[:switch], greedy(rest))
        assert result.output_ids == before.output_ids + after.output_ids
        assert same_experts(result.routed_experts, torch.cat([before.routed_experts, after.routed_experts]))
        await old.close()
        await new.close()

    try:
        asyncio.run(check())
    finally:
        asyncio.run(engine.close())


LORA = LoraConfig(rank=8, alpha=16.0, targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCORED = torch.randint(3, ARCH.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))


@dataclasses.dataclass
class LoraVersion:
    published: Published  # on disk, as the contract lays it out
    adapters: dict[str, torch.Tensor]  # PEFT-named
    logprobs: torch.Tensor  # the trainer's token logprobs of SCORED with these adapters


class LoraRun:
    """A LoRA run's versions on disk as meshy.dataplane.adapters' contract lays them out: the base as an HF
    directory <root>/base, each version a PEFT adapter directory <root>/v{version:06d}. The trainer's model
    (sharp_model(seed) with LORA's adapters) computes the expected logprobs."""

    def __init__(self, root: Path, seed: int):
        self.root, self.model = root, sharp_model(seed)
        whole = DirectoryPublisher(root / "whole", ARCH, dtype="float32").publish(self.model, 1)
        shutil.copytree(whole.location, root / "base")
        self.base = read_published(whole)[1]
        self.adapter = Adapter(LORA.rank, LORA.alpha, LORA_MODULES, whole.checksum)
        apply_lora(self.model, LORA)

    def version(self, version: int) -> LoraVersion:
        """The next version: every lora_B drawn anew (seeded by `version`; PEFT's zeros would change nothing)."""
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
            logprobs = token_logprobs(forward_logits(self.model, SCORED), SCORED)
        adapters = {name: tensor.detach().clone().contiguous() for name, tensor in adapter_tensors(self.model)}
        directory = self.root / f"v{version:06d}"
        directory.mkdir()
        save_file(adapters, directory / "adapter_model.safetensors", metadata={"format": "pt"})
        (directory / "adapter_config.json").write_text(json.dumps(self.adapter.peft_config(str(self.root / "base"))))
        checksum, size = tensors_checksum(adapters), sum(t.numel() * t.element_size() for t in adapters.values())
        published = Published(version, Transport.DISK, str(directory), checksum, size, 0.0, adapter=self.adapter)
        return LoraVersion(published, adapters, logprobs)


@pytest.fixture(scope="module")
def lora_engine(shared, tmp_path_factory):
    """One engine started from a LoRA version for the LoRA cases (in `shared`, closed with the module)."""
    for engine in shared:  # one SGLang engine per process at a time
        if not engine.closed:
            asyncio.run(engine.close())
    run = LoraRun(tmp_path_factory.mktemp("lora"), seed=0)
    first = run.version(1)
    shared.append(start_engine(first.published))
    return shared[-1], run, first


async def scored(engine) -> torch.Tensor:
    return torch.tensor([(await engine.score(row.tolist())).token_logprobs for row in SCORED])


async def adapters_in_sglang(engine) -> set[str]:
    """The adapters SGLang's registry holds (its own record, not the engine's)."""

    async def names() -> set[str]:
        for _ in range(100):  # unloads run in the background
            if not engine._unloading:
                break
            await asyncio.sleep(0.05)
        return set(engine._tokenizer_manager.lora_registry.get_all_adapters())

    return await engine._loop.run(names())


@async_case
async def test_a_lora_engine_serves_each_version_s_adapter_as_the_trainer_computes_it(lora_engine):
    """Started from a LoRA version on disk: SGLang's base from <root>/base, the adapter loaded by name; fp32
    logprobs within 1e-4 of the trainer's model with the same adapters (as SGLang against the reference
    engine), for the first version and for one loaded from tensors in memory; a version's adapter is
    unloaded once no request names it."""
    engine, run, first = lora_engine
    assert engine.weight_version == 1 and engine.lora_base == run.adapter.base
    assert (await scored(engine) - first.logprobs).abs().max().item() <= 1e-4
    result = await engine.generate("v1", prompt(50), greedy(8))
    assert result.token_versions == [1] * 8

    second = run.version(2)
    await engine.update_weights(2, second.adapters, adapter=run.adapter)
    assert engine.weight_version == 2
    assert (await scored(engine) - second.logprobs).abs().max().item() <= 1e-4
    assert (await engine.generate("v2", prompt(50), greedy(8))).token_versions == [2] * 8
    assert await adapters_in_sglang(engine) == {"v2"}


@async_case
async def test_a_lora_switch_continues_running_requests_under_the_new_adapter(lora_engine):
    """No pause: the new adapter loads while requests run, then each running request is aborted and goes on
    from its output so far under the new adapter, so its tokens are the old version's up to the switch and
    the new one's after it, each as that version alone produces it (up to the budget or the model's EOS,
    which the new version may reach early, depending on where the switch fell)."""
    engine, run, _ = lora_engine
    current = engine.weight_version
    ids = prompt(51)
    budget = MAX_LEN - len(ids)
    before = await engine.generate("before", ids, greedy(budget))
    new = run.version(current + 1)
    task = asyncio.create_task(engine.generate("long", ids, greedy(budget)))
    await probe(engine)
    await engine.update_weights(new.published.version, new.published)
    result = await task
    switch, produced = result.token_versions.index(new.published.version), len(result.output_ids)
    assert 0 < switch < produced
    assert result.token_versions == [current] * switch + [new.published.version] * (produced - switch)
    assert result.output_ids[:switch] == before.output_ids[:switch]
    after = await engine.generate("after", ids + result.output_ids[:switch], greedy(budget - switch))
    assert result.output_ids[switch:] == after.output_ids
    assert result.finish_reason == after.finish_reason
    assert result.logprobs[switch:] == pytest.approx(after.logprobs, abs=1e-5)
    assert await adapters_in_sglang(engine) == {f"v{new.published.version}"}


@async_case
async def test_lora_versions_the_engine_cannot_take_are_refused_naming_why(lora_engine, published, tmp_path):
    """Refused before SGLang sees them, the engine staying on its version: a whole model's version, an
    adapter of a higher rank or on other modules than SGLang's LoRA started with (SchemaError), adapters on
    a base the engine does not hold (CorruptWeights: a version carrying the base fixes it, and loads)."""
    engine, run, _ = lora_engine
    current = engine.weight_version
    with pytest.raises(SchemaError, match=r"v20 adapter: none \(a whole model's weights\)"):
        await engine.update_weights(20, dataclasses.replace(published[0], version=20))
    wider = dataclasses.replace(run.adapter, rank=16)
    with pytest.raises(SchemaError, match="v21 adapter rank: 16, above the rank SGLang's LoRA started with \\(8"):
        await engine.update_weights(21, {}, adapter=wider)
    other = dataclasses.replace(run.adapter, target_modules=("q_proj", "lm_head"))
    with pytest.raises(SchemaError, match=r"v22 adapter target_modules: \['lm_head'\] beyond"):
        await engine.update_weights(22, {}, adapter=other)
    adapters = run.version(23).adapters
    moved = dataclasses.replace(run.adapter, base="f" * 32)
    with pytest.raises(CorruptWeights, match=f"v23: adapters on base {'f' * 32}, and this engine holds base "):
        await engine.update_weights(23, adapters, adapter=moved)
    name = next(name for name in adapters if name.endswith("lora_A.weight"))
    with pytest.raises(SchemaError, match=r"lora_A \(8, 32\) and lora_B \(\d+, 8\), expected \(8, 64\)"):
        await engine.update_weights(23, {**adapters, name: adapters[name][:, :32]}, adapter=run.adapter)
    assert engine.weight_version == current

    other_base = LoraRun(tmp_path, seed=1)
    carried = other_base.version(24)
    await engine.update_weights(24, {**other_base.base, **carried.adapters}, adapter=other_base.adapter)
    assert engine.weight_version == 24 and engine.lora_base == other_base.adapter.base
    assert (await scored(engine) - carried.logprobs).abs().max().item() <= 1e-4
