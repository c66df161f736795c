"""Device placement, checked without a GPU.

The code under test runs with torch's default device set to "meta" while its model lives on the CPU.
A tensor created without naming its device then lands on "meta" and the first operation that meets a
real tensor fails, which is what such a tensor does on a GPU host ("Expected all tensors to be on the
same device", a CUDA tensor meeting a CPU one). torch keeps the default device per thread, so the
engine's scheduler is driven on the test's own thread.
"""

import asyncio
import contextlib
from concurrent.futures import Future

import pytest
import torch

from meshy.dataplane import columns as cols
from meshy.infer.engine import SamplingParams
from meshy.infer.reference_service import ReferenceService, ReferenceServiceConfig
from meshy.infer.torch_engine import TorchEngine, _Request, _Scheduler
from meshy.infer.torch_model import ModelConfig, load_model
from meshy.train import offload
from meshy.train.critic_service import CriticService, CriticServiceConfig, CriticTrainer, ValueModel
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.publish import DirectoryPublisher, hf_tensors
from meshy.train.routing_replay import FREE
from meshy.train.service import TrainingService, TrainServiceConfig
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LossConfig, OptimConfig, ParallelConfig
from tests.train.rows import add_routing, put_groups

ARCH = get_model("qwen3-tiny")
MOE = get_model("qwen3-tiny-moe")
CPU = torch.device("cpu")


@contextlib.contextmanager
def no_default_device():
    """Tensors created without a device land on "meta" (on this thread) until the block ends."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def test_the_guard_turns_a_tensor_without_a_device_into_an_error():
    real = torch.ones(3, device=CPU)
    with no_default_device(), pytest.raises((RuntimeError, NotImplementedError)):
        torch.stack([real.sum(), torch.tensor(1.0)]).tolist()
    with no_default_device():
        assert torch.stack([real.sum(), torch.tensor(1.0, device=CPU)]).tolist() == [3.0, 1.0]


def policy_batch(loss: LossConfig, seed: int = 0, routed: bool = False) -> PolicyBatch:
    """A batch for qwen3-tiny, or with `routed` for qwen3-tiny-moe with replayed experts at some positions."""
    g = torch.Generator().manual_seed(seed)
    b, t, k = 3, 9, 4
    tokens = torch.randint(0, ARCH.vocab_size, (b, t), generator=g)
    routed_experts = None
    if routed:
        layers, top_k = MOE.num_hidden_layers, MOE.num_experts_per_tok
        routed_experts = torch.rand(b, t - 1, layers, MOE.num_experts, generator=g).argsort(-1)[..., :top_k]
        routed_experts[:, :3] = FREE  # the prompt's positions route freely
    mask = (torch.rand(b, t - 1, generator=g) < 0.7).float()
    rollout = -torch.rand(b, t - 1, generator=g) - 0.5
    return PolicyBatch(
        tokens,
        mask,
        torch.randn(b, generator=g),
        rollout_logprobs=rollout,
        ref_logprobs=rollout - 0.1 if loss.kl_coef else None,
        teacher_topk_ids=torch.randint(0, ARCH.vocab_size, (b, t - 1, k), generator=g) if loss.distill_coef else None,
        teacher_topk_logprobs=-torch.rand(b, t - 1, k, generator=g) - 1 if loss.distill_coef else None,
        routed_experts=routed_experts,
    )


LOSSES = {
    "defaults": LossConfig(),  # entropy_coef 0: the entropy metric's path (the GPU recipes' first crash)
    "every-token-entropy-metric": LossConfig(entropy_metric_tokens=0),
    "mask-sequence-mean": LossConfig(tis="mask", aggregation="sequence_mean"),
    "no-tis": LossConfig(tis="none"),
    "entropy-bonus": LossConfig(entropy_coef=0.01),
    "kl-to-reference": LossConfig(kl_coef=0.1),
    "distillation": LossConfig(pg_coef=0.0, distill_coef=1.0),
    "pg-plus-distillation-tempered": LossConfig(distill_coef=0.5, temperature=0.7),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_policy_step_creates_every_tensor_where_its_model_lives(name):
    loss = LOSSES[name]
    model, _ = build_model(ARCH, ParallelConfig(), device=CPU, seed=0)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-3), loss)
    trainer.step(policy_batch(loss, seed=1))  # AdamW creates its step counters on the default device, by design
    batch = policy_batch(loss, seed=2)
    with no_default_device():
        batch.old_logprobs = trainer.logprobs(batch)  # the "old" policy of a multi-minibatch version
        metrics = trainer.step(batch)
    assert trainer.steps == 2 and torch.isfinite(torch.tensor(metrics["loss"], device=CPU))


def test_a_policy_step_replaying_a_mixture_s_routing_creates_every_tensor_where_its_model_lives():
    model, _ = build_model(MOE, ParallelConfig(), device=CPU, seed=0)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-3), LossConfig())
    trainer.step(policy_batch(LossConfig(), seed=1, routed=True))
    batch = policy_batch(LossConfig(), seed=2, routed=True)
    with no_default_device():
        batch.old_logprobs = trainer.logprobs(batch)
        metrics = trainer.step(batch)
    assert trainer.steps == 2 and torch.isfinite(torch.tensor(metrics["loss"], device=CPU))


def test_the_training_service_builds_and_trains_its_batches_on_its_model_s_device(client, unique, tmp_path):
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,))).name
    put_groups(client, table, range(4), 2, ARCH.vocab_size)
    model, _ = build_model(ARCH, ParallelConfig(), device=CPU, seed=0)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-3), LossConfig())
    config = TrainServiceConfig(table=table, groups_per_rank=2, minibatches=2, batch_timeout_s=5)
    service = TrainingService(client, trainer, NoPublish(), config)
    service.train_batch(service.wait_for_batch())  # the optimizer's first step, outside the guard
    with no_default_device():
        record = service.train_batch(service.wait_for_batch())
    service.close()
    assert record["rows_trained"] == 4 and record["rows_dropped"] == 0


def test_the_training_service_builds_replayed_routing_on_its_model_s_device(client, unique):
    layers, top_k = MOE.num_hidden_layers, MOE.num_experts_per_tok
    spec = cols.rollout_table(unique("rollout"), group_size=2, routed_experts=(layers, top_k), tasks=(cols.TRAIN_TASK,))
    table = client.create_table(spec).name
    rows = put_groups(client, table, range(4), 2, MOE.vocab_size)
    add_routing(client, table, rows, layers, top_k, MOE.num_experts)
    model, _ = build_model(MOE, ParallelConfig(), device=CPU, seed=0)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-3), LossConfig())
    config = TrainServiceConfig(table=table, groups_per_rank=2, minibatches=2, routing_replay=True, batch_timeout_s=1)
    service = TrainingService(client, trainer, NoPublish(), config)
    service.train_batch(service.wait_for_batch())  # the optimizer's first step, outside the guard
    with no_default_device():
        record = service.train_batch(service.wait_for_batch())
    service.close()
    assert record["rows_trained"] == 4 and record["replayed_tokens"] > 0


class NoPublish:
    def publish(self, model: torch.nn.Module, version: int) -> None:
        return None


def test_the_critic_values_and_trains_on_its_model_s_device(client, unique):
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2)).name
    add_returns(client, table, put_groups(client, table, range(2), 2, ARCH.vocab_size))
    backbone, _ = build_model(ARCH, ParallelConfig(), device=CPU, seed=0)
    trainer = CriticTrainer(ValueModel(backbone, ARCH.hidden_size, 0.5), OptimConfig(lr=1e-3))
    service = CriticService(client, trainer, CriticServiceConfig(table=table, groups_per_rank=1, batch_timeout_s=3))
    assert service.write_values() == 4
    assert service.train_step() is not None  # the optimizer's first step, outside the guard
    add_returns(client, table, put_groups(client, table, range(2, 3), 2, ARCH.vocab_size, seed=1))
    with no_default_device():
        assert service.write_values() == 2
        assert service.train_step() is not None


def add_returns(client, table: str, rows: list[int]) -> None:
    batch = client.lease(table, f"lengths-{rows[0]}", [cols.RESPONSE_IDS], count=64, min_count=1, timeout=3)
    client.release(batch)
    lengths = {r: len(response) for r, response in zip(batch.row_ids, batch.columns[cols.RESPONSE_IDS], strict=True)}
    client.add_columns(table, rows, {cols.RETURNS: [torch.ones(lengths[r], device=CPU) for r in rows]})


def test_a_trainer_moves_to_host_memory_and_back_with_everything_it_holds():
    model, _ = build_model(ARCH, ParallelConfig(), device=CPU, seed=0)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-3), LossConfig())
    trainer.step(policy_batch(LossConfig(), seed=1))
    before, batch = {k: v.clone() for k, v in model.state_dict().items()}, policy_batch(LossConfig(), seed=2)
    with no_default_device():
        offload.move(trainer, CPU)
        offload.move(trainer, CPU)
        trainer.step(batch)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def scheduler(max_running: int = 4, arch=ARCH) -> _Scheduler:
    model, _ = build_model(arch, ParallelConfig(), device=CPU, seed=3)
    config = ModelConfig.from_hf(arch.hf_config("float32"))
    engine_model = load_model(config, dict(hf_tensors(model, arch, torch.float32)), CPU, torch.float32)
    return _Scheduler(engine_model, config, max_running, 48, CPU, torch.float32, version=0)


def request(name: str, prompt: list[int], **params) -> _Request:
    return _Request(name, prompt, SamplingParams(max_new_tokens=6, **params), frozenset(), Future())


@pytest.mark.parametrize("arch", [ARCH, MOE], ids=["dense", "moe"])
def test_the_torch_engine_generates_scores_releases_and_onloads_on_its_device(arch):
    worker = scheduler(arch=arch)
    requests = [
        request("full", [1, 2, 3], seed=1),
        request("greedy", [4, 5], temperature=0.0),
        request("truncated", [6, 7, 8, 9], seed=2, top_k=5, top_p=0.9),
        request("unseeded", [3, 3]),
        request("waits", [1, 1, 1], seed=3),
    ]
    with no_default_device():
        for r in requests:
            worker.apply(r)
        worker.step()
        worker.release()  # mid-generation: the running requests keep their slots
        worker.onload()  # and their caches are recomputed
        while worker.busy():
            worker.step()
        scores = worker.score([1, 2, 3, 4, 5], top_k=3, start=1)
    for r in requests:
        generation = r.done.result()
        assert len(generation.output_ids) == 6, r.request_id
        routed = generation.routed_experts  # a mixture's routing, read back with each step's tokens
        assert (routed is None) if not arch.moe else tuple(routed.shape) == (6, arch.num_hidden_layers, 2)
    assert len(scores.token_logprobs) == 3 and len(scores.topk_ids[0]) == 3


def test_the_reference_service_builds_its_columns_on_the_host(client, unique, tmp_path):
    """The service's side of scoring: its rows' sequences, the scored and the empty columns (the engine's
    side runs on its worker thread; the scheduler test above covers it)."""
    table = client.create_table(cols.rollout_table(unique("rollout"))).name
    model, _ = build_model(ARCH, ParallelConfig(), device=CPU, seed=0)
    published = DirectoryPublisher(tmp_path, ARCH, dtype="float32").publish(model, 0)
    prompts = [torch.tensor([1, 2, 3], device=CPU)] * 3
    responses = [torch.tensor(r, dtype=torch.int64, device=CPU) for r in ([4, 5], [], [ARCH.vocab_size])]
    client.put(table, [0, 1, 2], {cols.PROMPT_IDS: prompts})
    client.add_columns(table, [0, 1, 2], {cols.RESPONSE_IDS: responses})
    engine = TorchEngine(published, max_running=4, max_len=32, device=CPU)
    service = ReferenceService(client, engine, ReferenceServiceConfig(table=table))

    async def serve() -> int:
        try:
            return await service.run(max_rows=3)
        finally:
            await engine.close()

    with no_default_device():
        assert asyncio.run(serve()) == 3
    batch = client.lease(table, "check", [cols.REF_LOGPROBS], count=3, timeout=5)
    assert sorted(len(ref) for ref in batch.columns[cols.REF_LOGPROBS]) == [0, 0, 2]
