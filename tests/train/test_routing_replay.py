"""Routing replay in the trainer: torchtitan's MoE forward with given experts for given positions."""

import pytest
import torch

from meshy.dataplane import HOST, SchemaError
from meshy.dataplane import columns as cols
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.routing_replay import FREE, replay_routers, replay_routing, routing_shape
from meshy.train.service import TrainingService, TrainServiceConfig
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LossConfig, OptimConfig, ParallelConfig
from tests.benches import load_bench
from tests.train.rows import add_routing, put_groups, response_lengths

MOE = get_model("qwen3-tiny-moe")
CPU = torch.device("cpu")


def tokens(batch: int = 3, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, MOE.vocab_size, (batch, length), generator=torch.Generator(HOST).manual_seed(seed))


def forward(model: torch.nn.Module, inputs: torch.Tensor, experts: torch.Tensor | None = None):
    """Logits, the experts each router chose [batch, seq, layers, top_k], and every parameter's gradient
    of the logits' sum."""
    chosen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen.append(out[1].detach())) for r in replay_routers(model)]
    try:
        with replay_routing(model, experts):
            logits = model(inputs)
            logits.float().sum().backward()
    finally:
        for hook in hooks:
            hook.remove()
    grads = {name: p.grad.clone() for name, p in parameters(model).items() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), torch.stack(chosen, dim=2), grads


def parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """By name, with or without activation checkpointing's wrappers."""
    return {name.replace("._checkpoint_wrapped_module", ""): p for name, p in model.named_parameters()}


def test_replaying_the_router_s_own_choice_is_the_free_forward_bit_for_bit():
    model, _ = build_model(MOE, ParallelConfig(), device=CPU, seed=0)
    inputs = tokens()
    free, chosen, free_grads = forward(model, inputs)
    replayed, used, grads = forward(model, inputs, chosen)
    assert torch.equal(used, chosen)
    assert torch.equal(replayed, free)
    assert free_grads.keys() == grads.keys() and all(torch.equal(free_grads[k], grads[k]) for k in grads)


def test_replayed_experts_give_the_forward_of_a_router_that_chose_them_and_the_router_still_learns():
    """A router's load-balancing bias (torchtitan's, which our Qwen3 models leave out: set here by hand)
    changes which experts it picks but not their gate weights: biased towards experts (3, 1) in layer 0 and
    (0, 2) in layer 1 it chooses them for every token itself, with the gate weights replay uses for them."""
    pairs = [(3, 1), (0, 2)]
    biased, _ = build_model(MOE, ParallelConfig(), device=CPU, seed=1)
    for layer, pair in enumerate(pairs):
        bias = torch.zeros(MOE.num_experts, device=CPU)
        bias[list(pair)] = 10.0
        biased.layers[str(layer)].moe.expert_bias_E = bias
    inputs = tokens(seed=1)
    chosen_logits, chosen, chosen_grads = forward(biased, inputs)
    assert [sorted(set(chosen[..., layer, :].flatten().tolist())) for layer in range(2)] == [[1, 3], [0, 2]]

    model, _ = build_model(MOE, ParallelConfig(), device=CPU, seed=1)
    experts = torch.tensor(pairs, device=CPU).expand(*inputs.shape, 2, 2)
    replayed, used, grads = forward(model, inputs, experts)
    free, _, _ = forward(model, inputs)
    assert torch.equal(used, experts)
    assert (replayed - chosen_logits).abs().max().item() <= 1e-5
    assert (replayed - free).abs().max().item() > 1e-2, "the free router picks other experts"
    for layer in range(2):
        gate = f"layers.{layer}.moe.router.gate.weight"
        assert grads[gate].abs().sum() > 0 and torch.allclose(grads[gate], chosen_grads[gate], atol=1e-6)


def test_only_the_positions_given_experts_are_replayed():
    model, _ = build_model(MOE, ParallelConfig(), device=CPU, seed=2)
    inputs = tokens(seed=2)
    free, chosen, _ = forward(model, inputs)
    experts = torch.full_like(chosen, FREE)
    experts[:, 6:] = (chosen[:, 6:] + 1) % MOE.num_experts  # other experts from position 6 on
    replayed, used, _ = forward(model, inputs, experts)
    assert torch.equal(replayed[:, :6], free[:, :6]), "a causal model: positions before 6 see no replayed token"
    assert torch.equal(used[:, :6], chosen[:, :6]) and torch.equal(used[:, 6:], experts[:, 6:])
    assert (replayed[:, 6:] - free[:, 6:]).abs().amax(dim=-1).min().item() > 0


def test_activation_checkpointing_recomputes_the_replayed_routing_in_the_backward():
    """Under full checkpointing each block's forward runs again during the backward: the step keeps the
    replay in force until its backward is done, so the gradients are those of the replayed forward (a
    backward after the replay ended would recompute another forward, which checkpointing refuses)."""
    inputs = tokens(seed=3)
    plain, _ = build_model(MOE, ParallelConfig(), device=CPU, seed=3)
    experts = (forward(plain, inputs)[1] + 1) % MOE.num_experts  # not what the routers would choose
    logits, _, grads = forward(plain, inputs, experts)
    checkpointed, _ = build_model(MOE, ParallelConfig(activation_checkpoint="full"), device=CPU, seed=3)
    checkpointed_logits, _, checkpointed_grads = forward(checkpointed, inputs, experts)
    assert torch.equal(checkpointed_logits, logits)
    assert all(torch.allclose(checkpointed_grads[k], grads[k], rtol=1e-4, atol=1e-6) for k in grads)
    with replay_routing(checkpointed, experts):
        out = checkpointed(inputs)
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="different number of tensors"):
        out.float().sum().backward()


def test_replay_refuses_a_dense_model_and_experts_of_the_wrong_shape():
    dense, _ = build_model(get_model("qwen3-tiny"), ParallelConfig(), device=CPU, seed=0)
    with pytest.raises(SchemaError, match="no mixture-of-experts layers"), replay_routing(dense, torch.zeros(1)):
        pass
    model, _ = build_model(MOE, ParallelConfig(), device=CPU, seed=0)
    assert routing_shape(model) == (2, 2, 4)
    wrong = torch.zeros(3, 11, 2, 3, dtype=torch.int64, device=CPU)
    shape_error = r"expected int64 \[batch, seq, 2, 2\], got int64 \(3, 11, 2, 3\)"
    with pytest.raises(SchemaError, match=shape_error), replay_routing(model, wrong):
        pass
    trainer = PolicyTrainer(model, OptimConfig(), LossConfig(tis="none"))
    batch = PolicyBatch(tokens(), torch.ones(3, 11, device=CPU), torch.ones(3, device=CPU))
    batch.routed_experts = torch.zeros(3, 10, 2, 2, dtype=torch.int64, device=CPU)
    with pytest.raises(SchemaError, match=r"PolicyBatch.routed_experts: expected shape \(3, 11\)"):
        trainer.step(batch)
    with pytest.raises(SchemaError, match="TrainServiceConfig.routing_replay: .*no mixture-of-experts layers"):
        TrainingService(
            None, PolicyTrainer(dense, OptimConfig(), LossConfig()), None, TrainServiceConfig(routing_replay=True)
        )


def test_the_training_service_replays_each_row_s_routing_and_drops_rows_it_cannot_replay(client, unique):
    spec = cols.rollout_table(unique("rollout"), group_size=2, routed_experts=(2, 2), tasks=(cols.TRAIN_TASK,))
    table = client.create_table(spec).name
    rows = put_groups(client, table, range(3), 2, MOE.vocab_size)
    add_routing(client, table, rows[:4], 2, 2, MOE.num_experts)
    lengths = response_lengths(client, table)
    outside = torch.full((lengths[4], 2, 2), MOE.num_experts, dtype=torch.int16, device=HOST)
    missing = torch.zeros(0, 2, 2, dtype=torch.int16, device=HOST)
    client.add_columns(table, [4, 5], {cols.ROUTED_EXPERTS: [outside, missing]})

    model, _ = build_model(MOE, ParallelConfig(), device=CPU, seed=0)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-3), LossConfig(tis="none"))
    config = TrainServiceConfig(table=table, groups_per_rank=3, routing_replay=True, batch_timeout_s=1)
    service = TrainingService(client, trainer, NoPublish(), config)
    record = service.train_batch(service.wait_for_batch())
    service.close()
    reasons = {d["row"]: d["reason"] for d in record["dropped"]}
    assert reasons == {
        4: "column routed_experts names an expert outside [0, 4)",
        5: f"column routed_experts has 0 entries for {lengths[5]} response tokens",
    }
    assert record["rows_trained"] == 4 and record["replayed_tokens"] == sum(lengths[r] for r in rows[:4])


class NoPublish:
    def publish(self, model: torch.nn.Module, version: int) -> None:
        return None


def test_replay_narrows_the_importance_ratio_after_a_policy_step():
    """bench/routing_replay.py, small (8 experts, top 2: more tokens near a tie between experts): TorchEngine
    samples and records routing; after one optimizer step the trainer's free routing differs from the
    engine's on some tokens, and replaying the engine's routing strictly narrows the spread of
    exp(trainer logprob - engine logprob)."""
    bench = load_bench("routing_replay")
    args = bench.arguments(["--experts", "8", "--top-k", "2", "--prompts", "16", "--response", "16"])
    same_free, same_replay, drift_free, drift_replay = bench.run(args)
    assert same_replay.std <= same_free.std and same_replay.max_abs <= same_free.max_abs
    assert drift_free.routing_differs > 0, "the step moved some tokens to other experts"
    assert drift_replay.std < drift_free.std and drift_replay.max_abs < drift_free.max_abs
