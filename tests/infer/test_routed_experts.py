"""A mixture-of-experts model's routing, recorded by TorchEngine for every generated token and written
to the rollout table by the inference service (what the trainer replays)."""

import asyncio
from concurrent.futures import Future

import pytest
import torch

from meshy.dataplane import HOST, SchemaError
from meshy.dataplane import columns as cols
from meshy.infer.engine import SamplingParams
from meshy.infer.inference_service import InferenceService, InferenceServiceConfig
from meshy.infer.torch_engine import TorchEngine, _Request, _Scheduler
from meshy.infer.torch_model import ModelConfig, _Causal, load_model
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.publish import DirectoryPublisher, hf_tensors
from meshy.train.training_config import ParallelConfig
from tests.infer.test_torch_engine import ARCH as DENSE
from tests.infer.test_torch_engine import sharp_weights

MOE = get_model("qwen3-tiny-moe")
CPU = torch.device("cpu")
LAYERS, TOP_K = MOE.num_hidden_layers, MOE.num_experts_per_tok


def moe_model(seed: int = 0) -> torch.nn.Module:
    """The trainer's tiny MoE with every matrix scaled 4x, so routers and next-token distributions are
    far from uniform."""
    model, _ = build_model(MOE, ParallelConfig(), device=CPU, seed=seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def moe_source() -> tuple[dict, dict[str, torch.Tensor]]:
    return MOE.hf_config("float32"), dict(hf_tensors(moe_model(), MOE, torch.float32))


def full_forward_routing(source, sequence: list[int]) -> torch.Tensor:
    """The experts every layer chooses at each position of one causal forward [seq, layers, top_k]."""
    config, tensors = source
    model = load_model(ModelConfig.from_hf(config), tensors, CPU, torch.float32)
    tokens = torch.tensor([sequence], device=CPU)
    positions = torch.arange(len(sequence), device=CPU)[None]
    with torch.no_grad():
        _, routed = model.hidden(tokens, positions, _Causal())
    return torch.stack(routed, dim=2)[0]


def as_sets(experts: torch.Tensor) -> list:
    return experts.sort(dim=-1).values.tolist()


def test_each_token_s_experts_are_what_the_engine_s_router_chose_on_that_token_s_hidden_states(moe_source):
    config, tensors = moe_source
    model_config = ModelConfig.from_hf(config)
    model = load_model(model_config, tensors, CPU, torch.float32)
    inputs: list[list[torch.Tensor]] = [[] for _ in range(LAYERS)]
    for layer, block in enumerate(model.model.layers):
        block.mlp.register_forward_hook(lambda _m, args, _out, layer=layer: inputs[layer].append(args[0]))
    worker = _Scheduler(model, model_config, 1, 64, CPU, torch.float32, version=0)
    request = _Request("one", [5, 6, 7, 8], SamplingParams(max_new_tokens=12, seed=1), frozenset(), Future())
    worker.apply(request)
    with torch.no_grad():
        while worker.busy():
            worker.step()
    generation = request.done.result()
    routed = generation.routed_experts
    assert routed.dtype == torch.int16 and routed.device == HOST and tuple(routed.shape) == (12, LAYERS, TOP_K)
    for layer, calls in enumerate(inputs):
        assert len(calls) == 12, "one prefill (its last position gives token 0), then a decode step per token"
        for token, hidden in enumerate(calls):
            _, chosen = model.model.layers[layer].mlp.route(hidden[0, -1:])  # one slot: row 0 is the request
            assert routed[token, layer].tolist() == chosen[0].tolist(), (token, layer)


def test_a_batch_of_requests_records_the_routing_of_a_full_forward_over_each_sequence(moe_source):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20], [30, 31, 32, 33, 34]]

    async def generate():
        engine = TorchEngine(moe_source, max_running=4, max_len=64)
        assert engine.records_routing
        try:
            return await asyncio.gather(
                *[engine.generate(f"r{i}", p, SamplingParams(max_new_tokens=10, seed=i)) for i, p in enumerate(prompts)]
            )
        finally:
            await engine.close()

    for prompt, generation in zip(prompts, asyncio.run(generate()), strict=True):
        n = len(generation.output_ids)
        assert tuple(generation.routed_experts.shape) == (n, LAYERS, TOP_K)
        full = full_forward_routing(moe_source, prompt + generation.output_ids)
        # Token i was sampled from the logits at position len(prompt) - 1 + i.
        assert as_sets(generation.routed_experts) == as_sets(full[len(prompt) - 1 : len(prompt) - 1 + n])


def test_a_dense_model_records_no_routing():
    async def generate():
        engine = TorchEngine((DENSE.hf_config("float32"), sharp_weights(0)), max_running=2, max_len=32)
        try:
            return engine.records_routing, await engine.generate("d", [5, 6], SamplingParams(max_new_tokens=3))
        finally:
            await engine.close()

    records, generation = asyncio.run(generate())
    assert not records and generation.routed_experts is None and len(generation.output_ids) >= 1


def replay_table(client, unique) -> str:
    spec = cols.rollout_table(unique("rollout"), routed_experts=(LAYERS, TOP_K))
    return client.create_table(spec).name


def test_the_service_writes_each_row_s_routing_across_a_weight_update_that_aborts_it(
    client, unique, tmp_path, moe_source
):
    """update_mode "abort": a request cut by a new version continues from its prefix, and its routing is
    the two attempts' routing one after the other. The new version holds the same weights, so every row
    must carry exactly the routing of a full forward over its sequence."""
    name, stream = replay_table(client, unique), unique("weights")
    prompts = [torch.tensor([5 + i, 6, 7, 8], device=HOST) for i in range(5)] + [torch.zeros(0, dtype=torch.int64)]
    rows = list(range(len(prompts)))
    client.put(name, rows, {cols.PROMPT_IDS: prompts})
    config = InferenceServiceConfig(
        table=name,
        sampling=SamplingParams(40, seed=2),
        context_length=64,
        weights_stream=stream,
        poll_s=0.05,
        update_mode="abort",
    )
    model = moe_model()
    engine = TorchEngine(moe_source, max_running=1, max_len=64, version=1)
    service = InferenceService(client, engine, config)

    async def serve():
        task = asyncio.create_task(service.run(max_rows=len(rows)))
        while service.stats.rows < 2:  # one request at a time: the update lands mid-run
            await asyncio.sleep(0.005)
        published = DirectoryPublisher(tmp_path, MOE, dtype="float32").publish(model, 2)
        client.append(stream, published.to_message())
        stats = await asyncio.wait_for(task, 120)
        await engine.close()
        return stats

    stats = asyncio.run(serve())
    assert stats.weight_updates == 1 and stats.continued >= 1 and stats.errors == 1
    batch = client.lease(name, "check", [cols.RESPONSE_IDS, cols.ROUTED_EXPERTS], count=len(rows), timeout=5)
    for row, response, routed in zip(
        batch.row_ids, batch.columns[cols.RESPONSE_IDS], batch.columns[cols.ROUTED_EXPERTS], strict=True
    ):
        prompt = prompts[row].tolist()
        assert routed.dtype == torch.int16 and tuple(routed.shape) == (len(response), LAYERS, TOP_K)
        if not prompt:
            assert len(response) == 0, "an error row carries an empty routing of the right shape"
            continue
        full = full_forward_routing(moe_source, prompt + response.tolist())
        assert as_sets(routed) == as_sets(full[len(prompt) - 1 : len(prompt) - 1 + len(response)]), row


def test_a_table_that_expects_routing_refuses_an_engine_that_records_none(client, unique):
    name = replay_table(client, unique)
    engine = TorchEngine((DENSE.hf_config("float32"), sharp_weights(0)), max_running=2, max_len=32)
    config = InferenceServiceConfig(
        table=name, sampling=SamplingParams(2), context_length=32, weights_stream=unique("w")
    )

    async def serve():
        try:
            await InferenceService(client, engine, config).run(max_rows=1)
        finally:
            await engine.close()

    with pytest.raises(SchemaError, match="declares routed_experts .* TorchEngine does not record routing"):
        asyncio.run(serve())
