import contextlib
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from meshy.dataplane import DataPlaneClient, LeaseLostError, SchemaError
from meshy.dataplane import columns as cols
from meshy.dataplane.weights import Published
from meshy.train import checkpoint
from meshy.train.critic_service import CriticService, CriticServiceConfig, CriticTrainer, ValueModel
from meshy.train.logprobs import pack_rows
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.publish import DirectoryPublisher
from meshy.train.service import OPTIONAL_COLUMNS, MetricsLog, TrainingService, TrainServiceConfig
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LossConfig, OptimConfig, ParallelConfig
from tests.train.rows import put_groups

REPO = Path(__file__).resolve().parents[2]
ARCH = get_model("qwen3-tiny")


def test_training_service_trains_whole_groups_acks_everything_and_publishes(client, unique, tmp_path):
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,))).name
    put_groups(client, table, range(4), 2, ARCH.vocab_size)
    put_groups(client, table, range(4, 5), 2, ARCH.vocab_size, version=-5, seed=1)  # too stale to train
    put_groups(client, table, range(5, 6), 2, ARCH.vocab_size, seed=2)
    client.put(table, [12, 13], {cols.PROMPT_IDS: [torch.tensor([1, 2])] * 2}, group_ids=[6, 6])
    client.add_columns(table, [12, 13], {
        cols.RESPONSE_IDS: [torch.tensor([3, 4, 5])] * 2,
        cols.ROLLOUT_LOGPROBS: [torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, -1.0, -1.0])],  # row 12: 2 for 3
        cols.TOKEN_VERSIONS: [torch.zeros(3, dtype=torch.int64)] * 2,
        cols.ADVANTAGE: [torch.ones(3), torch.tensor([1.0, float("nan"), 1.0])],  # row 13: not finite
    })  # fmt: skip
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stream = unique("weights")
    reader = client.reader(stream, "engine", start=1)
    config = TrainServiceConfig(table=table, groups_per_rank=7, minibatches=2, max_staleness=2, batch_timeout_s=5)
    service = TrainingService(
        client,
        PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig()),
        DirectoryPublisher(tmp_path / "weights", ARCH, client=client, dtype="float32", stream=stream),
        config,
        metrics=MetricsLog(tmp_path / "metrics.jsonl"),
    )
    service.publish_initial()
    record = service.train_batch(service.wait_for_batch())

    assert record["rows_trained"] + record["rows_dropped"] == 14
    reasons = sorted(d["reason"] for d in record["dropped"])
    assert reasons == [
        "column advantage is not finite",
        "column rollout_logprobs has 2 entries for 3 response tokens",
        "every token older than max_staleness=2",
        "every token older than max_staleness=2",
    ]
    assert record["rows_trained"] == 10
    assert record["staleness_histogram"]["0"] > 0 and record["staleness_histogram"]["5"] > 0  # on-policy; 5 behind
    for key in ("loss", "pg_loss", "clip_fraction", "ratio_mean", "grad_norm", "entropy", "tokens_per_s", "lr"):
        assert key in record, key
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["version"] == 1
    assert client.table_stats(table)["retired"] == 14  # every row acked, trained or dropped with a reason
    announced = [Published.from_message(m.payload).version for m in reader.read()]
    assert announced == [0, 1] and reader.audit.clean
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items()), "the step changed the weights"


def put_trajectories(client, table: str, observation: dict, masks: list[list[bool]] | None) -> None:
    """Two groups of two multi-turn rows: prompt, 2 policy tokens, 2 observation tokens, 2 policy tokens;
    `observation` gives the observation tokens' logprob, version and advantage (masks: the policy masks,
    None for a table without one)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    for group in range(2):
        ids = [2 * group, 2 * group + 1]
        client.put(table, ids, {cols.PROMPT_IDS: [torch.tensor([1, 2, 3], device="cpu")] * 2}, group_ids=[group] * 2)
        responses = [torch.randint(0, ARCH.vocab_size, (6,), generator=g, device="cpu") for _ in ids]
        columns = {cols.RESPONSE_IDS: responses, cols.ROLLOUT_LOGPROBS: [], cols.TOKEN_VERSIONS: [], cols.ADVANTAGE: []}
        for k in range(2):
            policy_logprobs = -torch.rand(6, generator=g, device="cpu") - 0.5
            at = torch.tensor([False, False, True, True, False, False], device="cpu")  # the observation's tokens
            columns[cols.ROLLOUT_LOGPROBS].append(torch.where(at, observation["logprob"], policy_logprobs))
            columns[cols.TOKEN_VERSIONS].append(torch.where(at, observation["version"], 0))
            columns[cols.ADVANTAGE].append(torch.where(at, observation["advantage"], 1.0 - 2 * k))
        if masks is not None:
            columns[cols.POLICY_MASK] = [torch.tensor(masks[i], device="cpu") for i in ids]
        client.add_columns(table, ids, columns)


@pytest.mark.parametrize("max_staleness", [None, 2])
def test_only_the_policy_s_tokens_of_a_multi_turn_row_are_trained(client, unique, tmp_path, max_staleness):
    """Whatever the observation tokens carry (logprob, version, advantage), the step is the same, bit for
    bit; without the mask the same rows train other weights; observation tokens count towards neither
    staleness nor the tokens trained."""
    policy = [True, True, False, False, True, True]
    runs = {
        "masked": ({"logprob": 0.0, "version": -1, "advantage": 1.0}, [policy] * 4),
        "masked, other observation values": ({"logprob": -7.0, "version": -100, "advantage": 50.0}, [policy] * 4),
        "no mask": ({"logprob": 0.0, "version": 0, "advantage": 1.0}, None),
    }
    weights, records = {}, {}
    for name, (observation, masks) in runs.items():
        multi_turn = masks is not None
        spec = cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,), multi_turn=multi_turn)
        table = client.create_table(spec).name
        put_trajectories(client, table, observation, masks)
        model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
        config = TrainServiceConfig(
            table=table, groups_per_rank=2, max_staleness=max_staleness, batch_timeout_s=5, policy_mask=multi_turn
        )
        trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig())
        service = TrainingService(client, trainer, DirectoryPublisher(tmp_path / name, ARCH, dtype="float32"), config)
        records[name] = service.train_batch(service.wait_for_batch())
        weights[name] = model.state_dict()
    masked, other, unmasked = (weights[name] for name in runs)
    assert all(torch.equal(masked[k], other[k]) for k in masked), "observation tokens changed the step"
    assert any(not torch.equal(masked[k], unmasked[k]) for k in masked), "the mask changed nothing"
    for name in list(runs)[:2]:
        assert records[name]["rows_trained"] == 4 and records[name]["staleness_histogram"] == {"0": 16}, name
        assert records[name]["tokens"] == 16, name
    assert records["no mask"]["tokens"] == 24


def test_a_multi_turn_row_without_policy_tokens_or_with_a_ragged_mask_is_dropped_with_its_reason(
    client, unique, tmp_path
):
    spec = cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,), multi_turn=True)
    table = client.create_table(spec).name
    masks = [[False] * 6, [True] * 3, [True] * 6, [True] * 6]
    put_trajectories(client, table, {"logprob": 0.0, "version": -1, "advantage": 1.0}, masks)
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    config = TrainServiceConfig(table=table, groups_per_rank=2, batch_timeout_s=5, policy_mask=True)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig())
    service = TrainingService(
        client, trainer, DirectoryPublisher(unique("/tmp/meshy-w"), ARCH, dtype="float32"), config
    )
    record = service.train_batch(service.wait_for_batch())
    assert record["rows_trained"] == 2
    assert sorted(d["reason"] for d in record["dropped"]) == [
        "column policy_mask has 3 entries for 6 response tokens",
        "no policy token: the response is observations only",
    ]


def test_critic_warmup_versions_train_nothing_but_publish_and_count(client, unique, tmp_path):
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,))).name
    put_groups(client, table, range(4), 2, ARCH.vocab_size)
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = TrainServiceConfig(table=table, groups_per_rank=2, critic_warmup_versions=1, batch_timeout_s=5)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig())
    service = TrainingService(client, trainer, DirectoryPublisher(tmp_path, ARCH, dtype="float32"), config)
    warmup = service.train_batch(service.wait_for_batch())
    assert warmup["rows_trained"] == 0 and [d["reason"] for d in warmup["dropped"]] == ["critic warm-up"] * 4
    assert warmup["tokens"] == 0 and warmup["staleness_histogram"] == {}, "no token trained, none counted stale"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert (tmp_path / "v000001").is_dir()
    assert service.train_batch(service.wait_for_batch())["rows_trained"] == 4 and trainer.steps == 1


def test_the_same_groups_train_the_same_weights_whatever_order_they_became_ready(client, unique, tmp_path):
    weights = []
    for name, ready in (("forward", range(8)), ("shuffled", [5, 0, 7, 2, 6, 1, 4, 3])):
        table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,))).name
        for group in ready:  # each group's rows depend only on its seed; the order only on `ready`
            put_groups(client, table, range(group, group + 1), 2, ARCH.vocab_size, seed=group)
        model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
        config = TrainServiceConfig(table=table, groups_per_rank=8, batch_timeout_s=5)
        trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig())
        service = TrainingService(client, trainer, DirectoryPublisher(tmp_path / name, ARCH, dtype="float32"), config)
        assert service.train_batch(service.wait_for_batch())["rows_trained"] == 16
        weights.append(model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), "bit-identical weights"


def test_with_batch_groups_each_version_trains_its_own_batch_whatever_is_ready_first(client, unique, tmp_path):
    """Bounded pacing's age bound needs batch v trained at version v: here batch 1 (groups 2, 3) is
    ready before batch 0 (groups 0, 1), and version 0 (and its prefetch, version 1) still takes its own."""
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,))).name
    put_groups(client, table, range(2, 4), 2, ARCH.vocab_size)
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    config = TrainServiceConfig(table=table, groups_per_rank=2, batch_timeout_s=5, batch_groups=2)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig())
    service = TrainingService(client, trainer, DirectoryPublisher(tmp_path, ARCH, dtype="float32"), config)
    threading.Timer(0.5, put_groups, (client, table, range(2), 2, ARCH.vocab_size)).start()
    assert service.train_batch(service.wait_for_batch())["row_ids"] == [0, 1, 2, 3]
    assert service.train_batch(service.wait_for_batch())["row_ids"] == [4, 5, 6, 7]
    service.close()


def one_reporting_version(client, table: str, task: cols.Task, tmp_path: Path) -> dict:
    """One version trained on two groups of `table` by a service that reports their reward: its record."""
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    config = TrainServiceConfig(table=table, task=task.name, groups_per_rank=2, batch_timeout_s=5, report_reward=True)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig())
    service = TrainingService(client, trainer, DirectoryPublisher(tmp_path, ARCH, dtype="float32"), config)
    return service.train_batch(service.wait_for_batch())


def test_reward_mean_counts_the_rows_dynamic_sampling_dropped(client, unique, tmp_path):
    """A group whose answers were all right has no advantage and is not trained; the version's reward
    is still its own rows' reward, so a policy that gets every group right reports 1, not nothing."""
    task = cols.train_with(reward=True)
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(task,))).name
    rows, rewards = [0, 1, 2, 3], [1.0, 1.0, 0.25, 0.75]
    client.put(table, rows, {cols.PROMPT_IDS: [torch.tensor([1, 2])] * 4}, group_ids=[0, 0, 1, 1])
    client.add_columns(table, rows, {
        cols.RESPONSE_IDS: [torch.tensor([3, 4, 5])] * 4,
        cols.ROLLOUT_LOGPROBS: [torch.full((3,), -1.0)] * 4,
        cols.TOKEN_VERSIONS: [torch.zeros(3, dtype=torch.int64)] * 4,
        # group 0's rewards are equal: rollout gives its rows an empty advantage (dynamic sampling)
        cols.ADVANTAGE: [torch.zeros(0), torch.zeros(0), torch.full((3,), -1.0), torch.full((3,), 1.0)],
        cols.REWARD: torch.tensor(rewards),
    })  # fmt: skip
    record = one_reporting_version(client, table, task, tmp_path)
    assert (record["rows_trained"], record["rows_dropped"]) == (2, 2)
    assert record["reward_mean"] == sum(rewards) / 4


def test_a_row_rollout_dropped_for_a_task_error_is_dropped_with_that_reason_not_as_an_empty_response(
    client, unique, tmp_path
):
    """on_task_error = "drop": a row the task's code (or the engine, on the task's prompt) failed on has a NaN
    reward and no advantage; an engine error leaves it no response either."""
    task = cols.train_with(reward=True)
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(task,))).name
    rows = [0, 1, 2, 3]
    client.put(table, rows, {cols.PROMPT_IDS: [torch.tensor([1, 2])] * 4}, group_ids=[0, 0, 1, 1])
    client.add_columns(table, rows, {
        cols.RESPONSE_IDS: [torch.tensor([3, 4, 5])] * 3 + [torch.zeros(0, dtype=torch.int64)],
        cols.ROLLOUT_LOGPROBS: [torch.full((3,), -1.0)] * 3 + [torch.zeros(0)],
        cols.TOKEN_VERSIONS: [torch.zeros(3, dtype=torch.int64)] * 3 + [torch.zeros(0, dtype=torch.int64)],
        cols.ADVANTAGE: [torch.full((3,), 1.0), torch.full((3,), -1.0), torch.zeros(0), torch.zeros(0)],
        cols.REWARD: torch.tensor([1.0, 0.0, float("nan"), float("nan")]),
    })  # fmt: skip
    record = one_reporting_version(client, table, task, tmp_path)
    assert record["rows_trained"] == 2
    assert [d["reason"] for d in record["dropped"]] == [
        "task error: rollout dropped it (on_task_error = drop; records/rollout-*.jsonl has the error)"
    ] * 2
    assert record["reward_mean"] == 0.5  # over the rows that were scored


def test_epochs_pass_over_a_version_s_minibatches_again_clipped_against_where_the_version_started(
    client, unique, tmp_path
):
    weights, steps, clipped = {}, {}, {}
    for epochs in (1, 2):
        table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,))).name
        put_groups(client, table, range(4), 2, ARCH.vocab_size)
        model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
        config = TrainServiceConfig(table=table, groups_per_rank=4, minibatches=2, epochs=epochs, batch_timeout_s=5)
        trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig(tis="none", clip_low=0.01, clip_high=0.01))
        publisher = DirectoryPublisher(tmp_path / str(epochs), ARCH, dtype="float32")
        service = TrainingService(client, trainer, publisher, config)
        record = service.train_batch(service.wait_for_batch())
        assert record["rows_trained"] == 8
        weights[epochs], steps[epochs], clipped[epochs] = model.state_dict(), trainer.steps, record["clip_fraction"]
    assert steps == {1: 2, 2: 4}
    assert any(not torch.equal(weights[1][k], weights[2][k]) for k in weights[1]), "the second pass trained"
    # The second pass's ratios are to the version's start, which its steps have moved from: a 1% clip
    # catches more of its tokens than of the first pass's.
    assert clipped[2] > clipped[1]


def checkpointing_service(client, config: TrainServiceConfig, tmp_path: Path) -> TrainingService:
    """A service training a tiny model from seed 0, with its metrics and checkpoints under tmp_path."""
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    return TrainingService(
        client,
        PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig(tis="none")),
        DirectoryPublisher(tmp_path / "weights", ARCH, dtype="float32"),
        config,
        metrics=MetricsLog(tmp_path / "metrics.jsonl"),
        checkpoint_dir=tmp_path / "checkpoints",
    )


def test_a_version_s_metrics_line_is_written_before_its_checkpoint(client, unique, tmp_path, monkeypatch):
    """A resumed run keeps the metrics lines up to its checkpoint's version: a process killed after saving
    version 4's checkpoint and before writing version 4's line left the run without it for good (the slow
    tier's kill test, under load). Each checkpoint must find its version's line already written."""
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,))).name
    put_groups(client, table, range(2), 2, ARCH.vocab_size)
    config = TrainServiceConfig(table=table, groups_per_rank=1, batch_timeout_s=5, checkpoint_every=1)
    service = checkpointing_service(client, config, tmp_path)
    found = {}
    save = checkpoint.BackgroundSaves.save  # checkpoint_in_background is the default

    def save_and_look(saves, step, trainer, cursors):
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        found[step] = [json.loads(line)["version"] for line in lines]
        return save(saves, step, trainer, cursors)

    monkeypatch.setattr(checkpoint.BackgroundSaves, "save", save_and_look)
    for _ in range(2):
        service.train_batch(service.wait_for_batch())
    service.close()  # finishes the checkpoint being written
    assert found == {1: [1], 2: [1, 2]}
    assert checkpoint.step_of(checkpoint.latest(tmp_path / "checkpoints")) == 2


@pytest.mark.parametrize("background", [False, True])
def test_with_ack_when_checkpointed_a_version_s_rows_retire_only_once_a_checkpoint_holds_it(
    client, unique, tmp_path, background
):
    """Rows trained after the newest checkpoint stay in the data plane, leased (and renewed) by the trainer, so
    that a run resumed from that checkpoint can train them again; a checkpoint written acks them."""
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,))).name
    put_groups(client, table, range(5), 2, ARCH.vocab_size)
    config = TrainServiceConfig(
        table=table,
        groups_per_rank=1,
        batch_timeout_s=5,
        lease_s=3.0,
        checkpoint_every=2,
        checkpoint_in_background=background,
        ack_when_checkpointed=True,
    )
    service = checkpointing_service(client, config, tmp_path)

    def trained() -> int:
        """Trains a version; how many rows have retired."""
        service.train_batch(service.wait_for_batch())
        return client.table_stats(table)["retired"]

    def written(version: int) -> None:
        deadline = time.monotonic() + 60
        while checkpoint.latest(tmp_path / "checkpoints") != tmp_path / "checkpoints" / f"step-{version:08d}":
            assert time.monotonic() < deadline, f"checkpoint {version} was not written"
            time.sleep(0.01)

    if background:
        assert [trained(), trained()] == [0, 0]  # version 2's checkpoint is being written
        written(2)
        assert trained() == 2 * 2, "versions 1 and 2 acked once their checkpoint was written"
        time.sleep(2.0)
        assert trained() == 2 * 2
        written(4)
        time.sleep(2.0)  # version 3's rows held past their 3 s lease: renewed meanwhile
        assert trained() == 4 * 2
    else:
        assert [trained() for _ in range(5)] == [0, 2 * 2, 2 * 2, 4 * 2, 4 * 2]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for m in lines for r in m["row_ids"]]
    assert sorted(rows) == list(range(10)), "every row trained once: no held row's lease ran out"
    service.close()
    with pytest.raises(SchemaError, match="ack_when_checkpointed: needs checkpoint_every >= 1"):
        TrainServiceConfig(table=table, ack_when_checkpointed=True)


def test_rows_held_for_a_checkpoint_whose_lease_is_lost_anyway_fail_the_next_version(
    client, unique, tmp_path, dataplane, secret
):
    """A held version's rows offered again (their lease released, here as for a consumer taken for dead) could
    be trained twice: the renewing thread notices and the next version raises instead of training."""
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,))).name
    put_groups(client, table, range(3), 2, ARCH.vocab_size)
    config = TrainServiceConfig(
        table=table, groups_per_rank=1, batch_timeout_s=5, lease_s=0.6, checkpoint_every=5, ack_when_checkpointed=True
    )
    service = checkpointing_service(client, config, tmp_path)
    service.train_batch(service.wait_for_batch())
    with DataPlaneClient(dataplane.endpoints, secret, name="other") as other:
        assert other.release_consumer(table, client.consumer_id) >= 1
    deadline = time.monotonic() + 30
    with pytest.raises(LeaseLostError):
        while time.monotonic() < deadline:  # the renewing thread tries every third of the lease
            time.sleep(0.1)
            service.train_batch(service.wait_for_batch())
    service.close()


def test_a_step_with_no_token_to_train_leaves_every_weight_where_it_is():
    """AdamW would move every weight along its momentum even with zero gradients: a step whose rows were
    all dropped (say, dynamic sampling once every group is right) must not move the policy."""
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig(tis="none", entropy_coef=0.01))
    tokens = torch.randint(0, ARCH.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    assert trainer.step(PolicyBatch(tokens, torch.ones(2, 5), torch.tensor([1.0, -1.0])))["stepped"] == 1.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = trainer.step(PolicyBatch(tokens, torch.zeros(2, 5), torch.zeros(2)))
    assert metrics["stepped"] == 0.0 and metrics["grad_norm"] == 0.0 and trainer.steps == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_step_whose_every_advantage_is_zero_is_not_steered_by_the_entropy_bonus_alone_unless_exploring():
    """Once every group gets every answer right, every advantage is 0 and the entropy bonus is all that is
    left: AdamW's full-size step along it alone flattened a learned policy to the uniform one. With a KL
    term there is still something to learn, and the step is taken; asked to explore, the step follows the
    entropy bonus, if there is one (without it, AdamW would move along its momentum alone)."""
    tokens = torch.randint(0, ARCH.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    for loss, explore, moves in (
        (LossConfig(tis="none", entropy_coef=0.03), False, False),
        (LossConfig(tis="none", kl_coef=0.1), False, True),
        (LossConfig(tis="none", entropy_coef=0.03), True, True),
        (LossConfig(tis="none"), True, False),
    ):
        model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
        trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), loss)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        ref = trainer.logprobs(PolicyBatch(tokens, torch.ones(2, 5), torch.zeros(2))) - 1.0
        metrics = trainer.step(PolicyBatch(tokens, torch.ones(2, 5), torch.zeros(2), ref_logprobs=ref), explore)
        assert metrics["stepped"] == float(moves), (loss, explore)
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items()) == moves, (loss, explore)


def test_a_version_that_scores_below_the_run_s_best_with_no_advantage_explores_on_the_entropy_bonus(
    client, unique, tmp_path
):
    """The trap a policy fell into (seen in the calculator recipe's learning run): it stopped making the
    call every reward needs, so every group scored 0, every advantage was 0 and no step was taken, and
    nothing could change that for 200 versions. A version below the best of the run's earlier versions
    steps on the entropy bonus alone; one at or above it (every group right) does not. The best survives a
    checkpoint."""
    task = cols.train_with(reward=True)
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(task,))).name
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    config = TrainServiceConfig(
        table=table, task=task.name, groups_per_rank=2, batch_timeout_s=5, report_reward=True, checkpoint_every=1
    )
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig(tis="none", entropy_coef=0.03))
    service = TrainingService(
        client, trainer, DirectoryPublisher(tmp_path, ARCH, dtype="float32"), config, checkpoint_dir=tmp_path / "ck"
    )

    def version(rewards: list[float], advantages: list[float]) -> dict:
        rows = list(range(service.version * 4, service.version * 4 + 4))
        group = service.version * 2
        client.put(table, rows, {cols.PROMPT_IDS: [torch.tensor([1, 2])] * 4}, group_ids=[group] * 2 + [group + 1] * 2)
        client.add_columns(table, rows, {
            cols.RESPONSE_IDS: [torch.tensor([3, 4, 5])] * 4,
            cols.ROLLOUT_LOGPROBS: [torch.full((3,), -1.0)] * 4,
            cols.TOKEN_VERSIONS: [torch.zeros(3, dtype=torch.int64)] * 4,
            cols.ADVANTAGE: [torch.full((3,), a) for a in advantages],
            cols.REWARD: torch.tensor(rewards),
        })  # fmt: skip
        return service.train_batch(service.wait_for_batch())

    learning = version([0.5, 0.0, 0.5, 0.0], [1.0, -1.0, 1.0, -1.0])
    lost = version([0.0] * 4, [0.0] * 4)  # below the best (0.25): explores
    solved = version([1.0] * 4, [0.0] * 4)  # the best yet: no step
    still = version([1.0] * 4, [0.0] * 4)  # at the best: no step
    assert [r["stepped"] for r in (learning, lost, solved, still)] == [1.0, 1.0, 0.0, 0.0]
    assert (service.best_reward, trainer.steps) == (1.0, 2)
    assert checkpoint.load(checkpoint.latest(tmp_path / "ck"), trainer)["best_reward"] == 1.0


def test_a_non_finite_loss_is_skipped_and_counted():
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig(tis="none"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, ARCH.vocab_size, (2, 6))
    mask = torch.ones(2, 5)
    metrics = trainer.step(PolicyBatch(tokens, mask, torch.tensor([1.0, float("inf")])))
    assert metrics["skipped_nonfinite"] == 1.0 and trainer.steps == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(SchemaError, match=r"PolicyBatch.mask: expected shape \(2, 5\), got \(2, 6\)"):
        trainer.step(PolicyBatch(tokens, torch.ones(2, 6), torch.zeros(2)))


def test_the_trainer_passes_dual_clip_to_the_loss():
    # Every token's ratio to the old logprobs is e^10 and its advantage negative: with the dual clip on,
    # each token's loss is the constant cap, so there is no gradient at all; off, the gradient is huge.
    tokens = torch.randint(0, ARCH.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    grad_norms = {}
    for dual_clip in (0.0, 3.0):
        model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
        trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig(tis="none", dual_clip=dual_clip))
        old = trainer.logprobs(PolicyBatch(tokens, torch.ones(2, 5), torch.zeros(2))) - 10.0
        metrics = trainer.step(PolicyBatch(tokens, torch.ones(2, 5), torch.tensor([-1.0, -1.0]), old_logprobs=old))
        grad_norms[dual_clip] = metrics["grad_norm"]
        assert metrics.get("dual_clip_fraction") == (1.0 if dual_clip else None)
    assert grad_norms[3.0] == 0.0 and grad_norms[0.0] > 100


def test_ranks_of_a_torchrun_trainer_lease_directly_and_versions_increase(client, unique, dataplane, secret, tmp_path):
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,))).name
    rows = put_groups(client, table, range(6), 2, ARCH.vocab_size)
    stream = unique("weights")
    reader = client.reader(stream, "audit", start=1)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MESHY_DATAPLANE_SECRET": secret.hex()}
    (tmp_path / "endpoints.json").write_text(dataplane.endpoints.to_json())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(Path(__file__).with_name("service_ranks.py")), str(tmp_path), table, stream]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in records] == [1, 2, 3]
    assert sum(r["rows_trained"] for r in records) == len(rows)  # 2 ranks x 1 group x 2 rows, 3 versions
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(per_rank[0] + per_rank[1]) == rows and not set(per_rank[0]) & set(per_rank[1])
    assert [Published.from_message(m.payload).version for m in reader.read()] == [0, 1, 2, 3]


def test_a_rank_that_starts_late_still_gets_its_rows_of_each_version(client, unique, dataplane, secret, tmp_path):
    """Lock-step rows (a version's groups appear only once the version before is published) and rank 0
    two seconds late: rank 1 must not prefetch, for its next version, the group rank 0 is waiting for."""
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,))).name
    stream = unique("weights")
    reader = client.reader(stream, "pacing", start=1)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MESHY_DATAPLANE_SECRET": secret.hex()}
    (tmp_path / "endpoints.json").write_text(dataplane.endpoints.to_json())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(Path(__file__).with_name("service_ranks.py")), str(tmp_path), table, stream, "late-rank-0"]
    trainers = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    written = 0
    for message in iter(lambda: reader.read(timeout=60), None):
        assert message, "the trainers stopped publishing"
        version = max(Published.from_message(m.payload).version for m in message)
        while written <= min(version, 2):  # the groups of batch `written`, once version `written` is out
            put_groups(client, table, range(2 * written, 2 * written + 2), 2, ARCH.vocab_size, version=written)
            written += 1
        if version == 3:
            break
    _, stderr = trainers.communicate(timeout=120)
    assert trainers.returncode == 0, stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["version"], r["rows_trained"]) for r in records] == [(1, 4), (2, 4), (3, 4)]


def test_critic_starts_at_the_mean_reward_and_learns_the_returns(client, unique):
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2)).name
    rows = put_groups(client, table, range(3), 2, ARCH.vocab_size)
    backbone, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    critic = ValueModel(backbone, ARCH.hidden_size, initial_value=0.52)
    service = CriticService(
        client,
        CriticTrainer(critic, OptimConfig(lr=3e-3, max_grad_norm=10.0)),
        CriticServiceConfig(table=table, rows_per_rank=6, groups_per_rank=3, batch_timeout_s=3),
    )
    assert service.write_values() == 6
    batch = client.lease(table, "check", [cols.PROMPT_IDS, cols.RESPONSE_IDS, cols.VALUES], count=6, timeout=2)
    for response, values in zip(batch.columns[cols.RESPONSE_IDS], batch.columns[cols.VALUES], strict=True):
        assert values.dtype == torch.float32 and len(values) == len(response)
        assert torch.all(values == 0.52)  # weight 0, bias = the mean reward
    returns = {
        r: torch.full((len(resp),), float(r % 2))
        for r, resp in zip(batch.row_ids, batch.columns[cols.RESPONSE_IDS], strict=True)
    }
    client.add_columns(table, rows, {cols.RETURNS: [returns[r] for r in rows]})
    losses = []
    for _ in range(8):
        service.config = CriticServiceConfig(
            table=table, train_task=unique("critic_train"), groups_per_rank=3, batch_timeout_s=3
        )
        losses.append(service.train_step()["value_loss"])
    assert losses[-1] < 0.7 * losses[0]
    tokens, spans = pack_rows(batch.columns[cols.PROMPT_IDS], batch.columns[cols.RESPONSE_IDS])
    with torch.no_grad():
        values = critic(tokens)
    means = [values[i, span].mean().item() for i, span in enumerate(spans)]
    high = [m for m, r in zip(means, batch.row_ids, strict=True) if r % 2]
    low = [m for m, r in zip(means, batch.row_ids, strict=True) if not r % 2]
    assert min(high) > max(low), "values moved toward each row's return"  # both started at 0.52


def test_a_critic_valuing_in_bursts_waits_for_the_burst_and_values_it_in_one_turn(client, unique):
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2)).name
    backbone, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    turns = []

    @contextlib.contextmanager
    def device_turn():
        turns.append(len(turns))
        yield

    config = CriticServiceConfig(table=table, rows_per_rank=8, burst_rows=4, burst_wait_s=60.0, batch_timeout_s=0.5)
    trainer = CriticTrainer(ValueModel(backbone, ARCH.hidden_size, initial_value=0.5), OptimConfig(lr=1e-2))
    service = CriticService(client, trainer, config, device_turn=device_turn)
    put_groups(client, table, range(1), 2, ARCH.vocab_size)
    assert service.write_values() == 0 and turns == [], "two ready rows of a burst of four wait for the rest"
    put_groups(client, table, range(1, 2), 2, ARCH.vocab_size)
    assert service.write_values() == 4 and len(turns) == 1, "the four rows were valued in one turn"


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"rows_per_rank": 8, "burst_rows": 9}, "burst_rows: expected 1 <= burst_rows <= rows_per_rank (8), got 9"),
        ({"burst_wait_s": float("nan")}, "CriticServiceConfig.burst_wait_s: expected finite seconds >= 0, got nan"),
    ],
)
def test_a_critic_s_bad_bursts_are_refused_naming_the_field(fields, error):
    with pytest.raises(SchemaError, match=re.escape(error)):
        CriticServiceConfig(**fields)


def test_the_critic_of_multi_turn_rows_learns_only_at_the_policy_s_tokens(client, unique):
    """Whatever value target the observation tokens carry, the critic's step is the same, bit for bit;
    without the mask the same rows train it otherwise."""
    policy = [True, True, False, False, True, True]
    weights = {}
    for name, target, masked in (("masked", 0.0, True), ("other target", 1000.0, True), ("no mask", 1000.0, False)):
        spec = cols.rollout_table(unique("rollout"), group_size=2, multi_turn=True)
        table = client.create_table(spec).name
        put_trajectories(client, table, {"logprob": 0.0, "version": -1, "advantage": 1.0}, [policy] * 4)
        backbone, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
        critic = ValueModel(backbone, ARCH.hidden_size, initial_value=0.5)
        config = CriticServiceConfig(
            table=table, rows_per_rank=4, groups_per_rank=2, batch_timeout_s=3, policy_mask=masked
        )
        service = CriticService(client, CriticTrainer(critic, OptimConfig(lr=1e-2)), config)
        assert service.write_values() == 4
        at = torch.tensor(policy, device="cpu")
        returns = torch.where(at, torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0], device="cpu"), target)
        client.add_columns(table, [0, 1, 2, 3], {cols.RETURNS: [returns] * 4})
        assert service.train_step() is not None
        weights[name] = critic.state_dict()
    masked, other, unmasked = weights.values()
    assert all(torch.equal(masked[k], other[k]) for k in masked), "observation targets changed the critic's step"
    assert any(not torch.equal(masked[k], unmasked[k]) for k in masked)


def test_closing_the_service_ends_a_prefetch_waiting_for_rows_that_will_not_come(client, unique, tmp_path):
    """After the last version, the rows prefetched for the next one may never come (the run is over):
    close() must not wait out the whole batch timeout."""
    table = client.create_table(cols.rollout_table(unique("rollout"), group_size=2, tasks=(cols.TRAIN_TASK,))).name
    put_groups(client, table, range(1), 2, ARCH.vocab_size)
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    config = TrainServiceConfig(table=table, groups_per_rank=1, batch_timeout_s=600)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig())
    service = TrainingService(client, trainer, DirectoryPublisher(tmp_path, ARCH, dtype="float32"), config)
    assert service.train_batch(service.wait_for_batch())["rows_trained"] == 2  # and now it prefetches
    start = time.monotonic()
    closer = threading.Thread(target=service.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive() and time.monotonic() - start < 5


def test_the_service_leases_what_the_dataflow_says_training_reads():
    """The service's table of optional columns and the dataplane's train_with (which the recipes' dataflow
    checks) name the same columns in the same order, for every combination of options."""
    for reward, distill, reference, routing, policy in itertools.product([False, True], repeat=5):
        config = TrainServiceConfig(
            report_reward=reward,
            distill=distill,
            kl_to_reference=reference,
            routing_replay=routing,
            policy_mask=policy,
        )
        task = cols.train_with(
            reward=reward, teacher=distill, reference=reference, routed_experts=routing, policy_mask=policy
        )
        assert config.columns == list(task.reads)


def test_every_optional_column_names_a_config_flag_and_a_policy_batch_field():
    flags = {f.name for f in dataclasses.fields(TrainServiceConfig) if f.type is bool}
    batch_fields = {f.name for f in dataclasses.fields(PolicyBatch)}
    for column in OPTIONAL_COLUMNS:
        assert column.flag in flags, column
        assert column.batch_field is None or column.batch_field in batch_fields, column
