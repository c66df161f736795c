"""The inference, teacher and reference services against a live data plane, with the pure-torch engine."""

import asyncio
import contextlib
import json
import re
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from meshy.dataplane import SchemaError
from meshy.dataplane import columns as cols
from meshy.dataplane.weight_sync import WeightSyncGroup
from meshy.dataplane.weights import Published, Transport, resync_stream
from meshy.infer.engine import SamplingParams
from meshy.infer.inference_service import InferenceService, InferenceServiceConfig
from meshy.infer.reference_service import ReferenceService, ReferenceServiceConfig
from meshy.infer.teacher_service import TeacherService, TeacherServiceConfig
from meshy.infer.torch_engine import TorchEngine
from meshy.train.logprobs import forward_logits, token_logprobs
from meshy.train.losses import kl_to_reference
from meshy.train.parallel import build_model
from meshy.train.publish import CollectivePublisher, DirectoryPublisher
from meshy.train.training_config import ParallelConfig
from tests.infer.test_torch_engine import ARCH, lora_updates, sharp_weights, trainer_logprobs

CHECK = [cols.RESPONSE_IDS, cols.ROLLOUT_LOGPROBS, cols.TOKEN_VERSIONS, cols.FINISH_REASON, cols.TRUNCATED, cols.ERROR]


def table(client, unique, group_size=1):
    return client.create_table(cols.rollout_table(unique("rollout"), group_size=group_size, teacher_topk=4)).name


def engine(max_running=8, version=1, seed=0):
    return TorchEngine(
        (ARCH.hf_config("float32"), sharp_weights(seed)), max_running=max_running, max_len=128, version=version
    )


async def serve(client, config: InferenceServiceConfig, rows: int):
    """An inference service on a fresh engine until it has written `rows` rows; its stats."""
    e = engine()
    try:
        return await InferenceService(client, e, config).run(max_rows=rows)
    finally:
        await e.close()


def test_inference_writes_responses_and_reports_bad_rows_without_stopping(client, unique):
    name = table(client, unique)
    prompts = [torch.tensor([5, 6, 7])] * 6 + [
        torch.zeros(0, dtype=torch.int64),
        torch.arange(3, 131),
        torch.tensor([5, ARCH.vocab_size + 3]),
    ]
    client.put(name, list(range(len(prompts))), {cols.PROMPT_IDS: prompts})
    config = InferenceServiceConfig(
        table=name,
        sampling=SamplingParams(8, temperature=1.0, seed=3),
        context_length=128,
        weights_stream=unique("weights"),
    )

    stats = asyncio.run(serve(client, config, len(prompts)))
    assert stats.rows == 9 and stats.errors == 3
    reasons = stats.error_reasons
    assert reasons["prompt_ids is empty"] == 1 and reasons["prompt of 128 tokens does not fit the context of 128"] == 1
    assert len(reasons) == 3 and sum(reasons.values()) == 3  # and the token id outside the vocabulary
    batch = client.lease(name, "check", CHECK, count=9, timeout=5)
    c = dict(zip(batch.row_ids, range(9), strict=True))
    for row in range(6):
        i = c[row]
        n = len(batch.columns[cols.RESPONSE_IDS][i])
        assert 1 <= n <= 8 and batch.columns[cols.ERROR][i] == ""
        assert (
            len(batch.columns[cols.ROLLOUT_LOGPROBS][i]) == n and (batch.columns[cols.ROLLOUT_LOGPROBS][i] <= 0).all()
        )
        assert batch.columns[cols.TOKEN_VERSIONS][i].tolist() == [1] * n
        finish = batch.columns[cols.FINISH_REASON][i]
        assert finish in ("stop", "length") and bool(batch.columns[cols.TRUNCATED][i]) == (finish == "length")
    errors = [batch.columns[cols.ERROR][c[row]] for row in (6, 7, 8)]
    assert errors[0] == "prompt_ids is empty"
    assert errors[1] == "prompt of 128 tokens does not fit the context of 128"
    assert "input_ids" in errors[2] and str(ARCH.vocab_size) in errors[2]
    for row in (6, 7, 8):
        assert (
            batch.columns[cols.FINISH_REASON][c[row]] == "error" and len(batch.columns[cols.RESPONSE_IDS][c[row]]) == 0
        )


def test_rows_of_a_table_with_a_max_new_tokens_column_are_each_cut_at_their_own_budget(client, unique):
    name = client.create_table(cols.turns_table(unique("turns"))).name
    budgets = [1, 2, 5, 0]
    client.put(
        name,
        list(range(len(budgets))),
        {
            cols.PROMPT_IDS: [torch.tensor([5, 6, 7], device="cpu")] * len(budgets),
            cols.MAX_NEW_TOKENS: torch.tensor(budgets, device="cpu"),
        },
    )
    config = InferenceServiceConfig(
        table=name,
        sampling=SamplingParams(4, temperature=1.0, seed=3),
        context_length=128,
        weights_stream=unique("weights"),
    )

    assert asyncio.run(serve(client, config, len(budgets))).errors == 1
    batch = client.lease(name, "check", CHECK, count=len(budgets), timeout=5)
    by_row = {row: i for i, row in enumerate(batch.row_ids)}
    lengths = [len(batch.columns[cols.RESPONSE_IDS][by_row[row]]) for row in range(len(budgets))]
    assert lengths[0] == 1 and 1 <= lengths[1] <= 2 and 1 <= lengths[2] <= 4 and lengths[3] == 0, lengths
    assert batch.columns[cols.FINISH_REASON][by_row[0]] == "length"  # cut at the row's budget of 1
    assert batch.columns[cols.ERROR][by_row[3]] == "max_new_tokens of the row: expected >= 1, got 0"


@pytest.mark.parametrize("update_mode", ["abort", "in_place"])
def test_a_new_version_mid_generation_is_loaded_and_every_token_keeps_its_version(
    update_mode, client, unique, tmp_path
):
    name = table(client, unique)
    rows = list(range(6))
    client.put(name, rows, {cols.PROMPT_IDS: [torch.tensor([5, 6, 7, 8])] * 6})
    stream = unique("weights")
    config = InferenceServiceConfig(
        table=name,
        sampling=SamplingParams(120, temperature=0.0),
        context_length=128,
        weights_stream=stream,
        poll_s=0.05,
        update_mode=update_mode,
    )
    directory = tmp_path / "v000002"
    e = engine(max_running=1)  # one request at a time: the update lands in the middle of the run
    service = InferenceService(client, e, config)

    async def serve():
        task = asyncio.create_task(service.run(max_rows=len(rows)))
        while service.stats.rows < 2:  # two requests done (one at a time): the third is under way
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)
        from meshy.train.models import get_model
        from meshy.train.parallel import build_model, load_weights
        from meshy.train.training_config import ParallelConfig

        model, _ = build_model(get_model("qwen3-tiny"), ParallelConfig(), device="cpu")
        load_weights(model, ARCH, sharp_weights(1))
        published = DirectoryPublisher(tmp_path, ARCH, dtype="float32").publish(model, 2)
        client.append(stream, published.to_message())
        stats = await asyncio.wait_for(task, 120)
        await e.close()
        return stats, published

    stats, published = asyncio.run(serve())
    assert stats.weight_updates == 1 and stats.versions == [2] and e.weight_version == 2
    assert directory.is_dir() and isinstance(published, Published)
    batch = client.lease(name, "check", CHECK, count=6, timeout=5)
    switches = 0
    for versions, response in zip(batch.columns[cols.TOKEN_VERSIONS], batch.columns[cols.RESPONSE_IDS], strict=True):
        v = versions.tolist()
        assert v == sorted(v) and set(v) <= {1, 2} and len(v) == len(response)
        switches += len(set(v)) == 2
    assert switches >= 1, "a request spanned the update, its prefix kept version 1"
    assert (stats.continued >= 1) == (update_mode == "abort"), "aborted requests continued from their prefix"
    assert any(set(v.tolist()) == {1} for v in batch.columns[cols.TOKEN_VERSIONS])
    assert any(set(v.tolist()) == {2} for v in batch.columns[cols.TOKEN_VERSIONS])


class CountingPauses(TorchEngine):
    """A TorchEngine that counts the service's pauses, and may say it switches adapters live (as SGLangEngine
    with LoRA does: then the service must not hold generation for a LoRA version)."""

    def __init__(self, *args, live: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.switches_adapters_live = live
        self.pauses = 0

    async def pause(self) -> None:
        self.pauses += 1
        await super().pause()


@pytest.mark.parametrize(("update_mode", "live"), [("abort", False), ("in_place", False), ("abort", True)])
def test_an_adapter_switch_mid_generation_keeps_every_token_s_version(update_mode, live, client, unique, tmp_path):
    """LoRA versions: the engine starts from v1 (base and adapters), v2 (adapters only) lands mid-generation.
    Every token's recorded version is the one whose adapters produced it: a token of v1 has v1's logprob, and
    with update_mode abort (the prefix recomputed under the new weights) a token of v2 has v2's. An engine that
    switches adapters live is neither paused nor its requests aborted by the service."""
    from meshy.train.parallel import load_weights
    from meshy.train.training_config import LoraConfig

    lora = LoraConfig(rank=4, alpha=8.0, targets=("wq", "wv", "w2"))
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", lora=lora)
    load_weights(model, ARCH, sharp_weights(0))
    publisher = DirectoryPublisher(tmp_path, ARCH, dtype="float32", keep=4)
    first = publisher.publish(model, 1)
    name, stream, rows = table(client, unique), unique("weights"), list(range(4))
    client.put(name, rows, {cols.PROMPT_IDS: [torch.tensor([5, 6, 7, 8])] * len(rows)})
    config = InferenceServiceConfig(
        table=name,
        sampling=SamplingParams(100, temperature=0.0),
        context_length=128,
        weights_stream=stream,
        poll_s=0.05,
        update_mode=update_mode,
    )
    e = CountingPauses(first, max_running=1, max_len=128, live=live)  # one request at a time: lands mid-run
    service = InferenceService(client, e, config)

    async def serve():
        task = asyncio.create_task(service.run(max_rows=len(rows)))
        while service.stats.rows < 1:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if parameter_name.endswith("lora_B.weight"):
                    parameter.normal_(std=0.3, generator=torch.Generator().manual_seed(1))
        second = publisher.publish(model, 2)
        client.append(stream, second.to_message())
        stats = await asyncio.wait_for(task, 120)
        await e.close()
        return stats, second

    stats, second = asyncio.run(serve())
    assert stats.versions == [2] and e.weight_version == 2 and e.lora_base == first.adapter.base
    batch = client.lease(name, "check", CHECK, count=len(rows), timeout=5)
    references = {1: TorchEngine(first, max_len=128), 2: TorchEngine(second, max_len=128)}

    async def check() -> int:
        switches = 0
        for response, logprobs, versions in zip(
            *(batch.columns[c] for c in (cols.RESPONSE_IDS, cols.ROLLOUT_LOGPROBS, cols.TOKEN_VERSIONS)), strict=True
        ):
            v = versions.tolist()
            assert v == sorted(v) and set(v) <= {1, 2} and len(v) == len(response)
            switches += len(set(v)) == 2
            sequence = [5, 6, 7, 8, *response.tolist()]
            for version, reference in references.items():
                scored = torch.tensor((await reference.score(sequence, start=3)).token_logprobs)
                mine = torch.tensor(v) == version
                if mine.any() and (version == 1 or (update_mode == "abort" and not live)):
                    assert (scored[mine] - logprobs[mine]).abs().max().item() <= 1e-4, (version, v)
        for reference in references.values():
            await reference.close()
        return switches

    assert asyncio.run(check()) >= 1, "a request spanned the update, its prefix kept version 1"
    assert (stats.continued >= 1) == (update_mode == "abort" and not live)
    assert (e.pauses == 0) == live


def test_prompts_written_after_a_version_was_announced_are_generated_by_that_version(client, unique, tmp_path):
    """What on-policy pacing relies on: rollout sees version v announced, then writes prompts meant for v;
    however late the background watcher is, none of them may be generated by an older version."""
    from meshy.train.models import get_model
    from meshy.train.parallel import build_model
    from meshy.train.training_config import ParallelConfig

    name, stream = table(client, unique), unique("weights")
    model, _ = build_model(get_model("qwen3-tiny"), ParallelConfig(), device="cpu")
    publisher = DirectoryPublisher(tmp_path, ARCH, dtype="float32", keep=16)
    config = InferenceServiceConfig(
        table=name, sampling=SamplingParams(2, seed=1), context_length=64, weights_stream=stream
    )
    versions, per_version = range(2, 12), 4
    e = engine(version=1)
    service = InferenceService(client, e, config)

    async def serve():
        task = asyncio.create_task(service.run(max_rows=len(versions) * per_version))
        for i, version in enumerate(versions):
            client.append(stream, publisher.publish(model, version).to_message())
            rows = list(range(i * per_version, (i + 1) * per_version))
            client.put(name, rows, {cols.PROMPT_IDS: [torch.tensor([5, 6, 7, 8])] * per_version})
            while service.stats.rows < rows[-1] + 1:  # lock-step, as on-policy rollout paces
                await asyncio.sleep(0.002)
        stats = await asyncio.wait_for(task, 60)
        await e.close()
        return stats

    stats = asyncio.run(serve())
    assert stats.versions == list(versions)
    batch = client.lease(name, "check", CHECK, count=len(versions) * per_version, timeout=5)
    tokens = batch.columns[cols.TOKEN_VERSIONS]
    generated_by = {row: set(v.tolist()) for row, v in zip(batch.row_ids, tokens, strict=True)}
    assert generated_by == {row: {versions[row // per_version]} for row in range(len(versions) * per_version)}


def test_an_engine_that_cannot_rebuild_a_broadcast_delta_asks_for_a_whole_version_and_gets_it(client, unique):
    """publish = "collective" with delta: v2 arrives as a delta on a base the engine does not hold (as if
    v1 had not arrived intact); the engine keeps serving v1 and asks on the resync stream; the publisher's
    next version is whole, though its schedule (a whole one every 100th) would send a delta."""
    name, stream = table(client, unique), unique("weights")
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=3)
    store, groups = dist.HashStore(), {}
    joining = threading.Thread(target=lambda: groups.update(publisher=WeightSyncGroup(store, 0, 2, timeout_s=60)))
    joining.start()
    engine_group = WeightSyncGroup(store, 1, 2, timeout_s=60)
    joining.join()
    publisher = CollectivePublisher(
        groups["publisher"], ARCH, client, dtype="float32", stream=stream, delta=True, full_every=100
    )
    config = InferenceServiceConfig(
        table=name, sampling=SamplingParams(2, seed=1), context_length=64, weights_stream=stream
    )
    e = engine(version=0)
    service = InferenceService(client, e, config, weight_sync=engine_group)
    resync = client.reader(resync_stream(stream), "test", start=1)
    announced = client.reader(stream, "test", start=1)

    async def loaded(version: int) -> None:  # received, verified and loaded
        while e.weight_version != version:
            await asyncio.sleep(0.01)

    async def serve():
        task = asyncio.create_task(service.run(max_rows=1))
        for version in (1, 2, 3):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1e-3)
            if version == 2:
                engine_group._base_version = None  # the base v1 is gone: v2's delta cannot be rebuilt
            await asyncio.to_thread(publisher.publish, model, version)  # returns once the engine has it
            if version == 2:
                asked = await asyncio.to_thread(resync.read, 16, 30)
            else:
                await asyncio.wait_for(loaded(version), 30)
        client.put(name, [0], {cols.PROMPT_IDS: [torch.tensor([5, 6, 7, 8])]})
        stats = await asyncio.wait_for(task, 60)
        await e.close()
        return stats, asked

    stats, asked = asyncio.run(serve())
    assert [m.payload["version"] for m in asked] == [2] and "a delta on v1" in asked[0].payload["error"]
    assert asked[0].payload["engine"] == client.consumer_id
    assert stats.versions == [1, 3] and stats.failed_loads == 1
    kinds = [("delta" in json.loads(m.payload["location"])) for m in announced.read(16)]
    assert kinds == [False, True, False]


def test_an_engine_without_the_base_of_a_broadcast_adapter_version_asks_for_its_base_and_gets_it(client, unique):
    """publish = "collective" with LoRA: v1 carries the base and its adapters, v2 the adapters alone, loaded
    onto the base the engine holds; then the engine's base is gone (as for an engine that joined late): v3's
    adapters cannot apply, the engine keeps serving v2 and asks on the resync stream, and v4 comes with
    its base."""
    from meshy.train.parallel import load_weights
    from meshy.train.training_config import LoraConfig

    name, stream = table(client, unique), unique("weights")
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", lora=LoraConfig(rank=2, targets=("wq", "w1")))
    load_weights(model, ARCH, sharp_weights(3))
    store, groups = dist.HashStore(), {}
    joining = threading.Thread(target=lambda: groups.update(publisher=WeightSyncGroup(store, 0, 2, timeout_s=60)))
    joining.start()
    engine_group = WeightSyncGroup(store, 1, 2, timeout_s=60)
    joining.join()
    publisher = CollectivePublisher(groups["publisher"], ARCH, client, dtype="float32", stream=stream)
    config = InferenceServiceConfig(
        table=name, sampling=SamplingParams(2, seed=1), context_length=64, weights_stream=stream
    )
    e = engine(version=0)
    service = InferenceService(client, e, config, weight_sync=engine_group)
    resync = client.reader(resync_stream(stream), "test", start=1)
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])

    async def loaded(version: int) -> None:
        while e.weight_version != version:
            await asyncio.sleep(0.01)

    async def serve():
        task = asyncio.create_task(service.run(max_rows=1))
        for version in (1, 2, 3, 4):
            with torch.no_grad():
                for parameter_name, parameter in model.named_parameters():
                    if parameter_name.endswith("lora_B.weight"):
                        parameter.add_(0.1)
            if version == 3:
                e._scheduler.base = "another-base"  # what the engine holds is not v3's base
            published = await asyncio.to_thread(publisher.publish, model, version)  # returns once received
            if version == 3:
                asked = await asyncio.to_thread(resync.read, 16, 30)
            else:
                await asyncio.wait_for(loaded(version), 30)
                assert e.lora_base == published.adapter.base
                expected = trainer_logprobs(model, tokens)[0].tolist()
                assert (await e.score(tokens[0].tolist())).token_logprobs == pytest.approx(expected, abs=1e-5)
        client.put(name, [0], {cols.PROMPT_IDS: [torch.tensor([5, 6, 7, 8])]})
        stats = await asyncio.wait_for(task, 60)
        await e.close()
        return stats, asked

    stats, asked = asyncio.run(serve())
    assert [m.payload["version"] for m in asked] == [3] and "another-base" in asked[0].payload["error"]
    assert stats.versions == [1, 2, 4] and stats.failed_loads == 1


def test_a_broadcast_adapter_version_with_its_base_followed_by_others_is_loaded_before_they_are_received(client):
    """The tensors a member receives last only until its next receive: when announcements of v1 (with its base)
    and v2 (adapters alone) are joined together, v1 is loaded before v2 is received, so v2 has its base."""
    lora = lora_updates()
    first, second = lora.with_base, lora.adapters_only
    received: list[tuple[int, str | None]] = []

    class Member:  # the weight-sync group as an engine's member of it sees it
        def receive(self, published: Published, held_base: str | None = None):
            received.append((published.version, held_base))
            return {}, {first.version: first.source, second.version: second.source}[published.version]

    e = engine(version=0)
    service = InferenceService(client, e, InferenceServiceConfig(), weight_sync=Member())
    announced = [
        SimpleNamespace(payload=Published(u.version, Transport.COLLECTIVE, "{}", "-", 0, 0.0, u.adapter).to_message())
        for u in (first, second)
    ]
    asyncio.run(service._load_newest(announced))
    assert received == [(first.version, None), (second.version, first.adapter.base)]
    assert service.stats.versions == [first.version, second.version] and e.weight_version == second.version
    asyncio.run(e.close())


def test_in_waves_the_same_rows_generate_the_same_tokens_and_logprobs_bit_for_bit(client, unique):
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, ARCH.vocab_size, (int(n),), generator=g) for n in torch.randint(2, 12, (40,), generator=g)
    ]
    config = dict(
        max_in_flight=16, sampling=SamplingParams(12, temperature=1.0, seed=5), context_length=128, waves=True
    )

    def generate() -> dict[int, tuple[list[int], list[float]]]:
        name = table(client, unique)
        client.put(name, list(range(len(prompts))), {cols.PROMPT_IDS: prompts})
        service_config = InferenceServiceConfig(table=name, weights_stream=unique("weights"), **config)

        async def serve():
            e = engine(max_running=16)
            try:
                await InferenceService(client, e, service_config).run(max_rows=len(prompts))
            finally:
                await e.close()

        asyncio.run(serve())
        batch = client.lease(name, "check", CHECK, count=len(prompts), timeout=5)
        columns = zip(batch.columns[cols.RESPONSE_IDS], batch.columns[cols.ROLLOUT_LOGPROBS], strict=True)
        return {
            row: (ids.tolist(), logprobs.tolist()) for row, (ids, logprobs) in zip(batch.row_ids, columns, strict=True)
        }

    first, second = generate(), generate()
    assert first == second
    assert len({len(ids) for ids, _ in first.values()}) > 1, "requests of several lengths finish at several steps"


def partial_tables(client, unique) -> tuple[str, str]:
    rollout = table(client, unique)
    return rollout, client.create_table(cols.partials_table(unique("partials"))).name


def chunked(unique, rollout: str, partials: str, max_new_tokens: int, every: int) -> InferenceServiceConfig:
    """A service that keeps each response in progress in chunks of `every` tokens."""
    return InferenceServiceConfig(
        table=rollout,
        sampling=SamplingParams(max_new_tokens, temperature=1.0, seed=3),
        context_length=128,
        weights_stream=unique("weights"),
        partials_table=partials,
        partial_every=every,
    )


def test_a_response_in_progress_is_written_in_chunks_as_it_goes_and_dropped_once_the_response_is(client, unique):
    rollout, partials = partial_tables(client, unique)
    prompts = [torch.tensor([5, 6, 7 + r]) for r in range(6)]
    client.put(rollout, list(range(6)), {cols.PROMPT_IDS: prompts})
    stats = asyncio.run(serve(client, chunked(unique, rollout, partials, 9, 2), 6))
    batch = client.lease(rollout, "check", CHECK, count=6, timeout=5)
    lengths = [len(r) for r in batch.columns[cols.RESPONSE_IDS]]
    assert max(lengths) > 2, lengths
    assert stats.partial_chunks == sum(-(-n // 2) - 1 for n in lengths), "a chunk at every 2 tokens before the end"
    assert all(len(v) == n for v, n in zip(batch.columns[cols.TOKEN_VERSIONS], lengths, strict=True))
    assert client.table_stats(partials)["rows"] == 0 and client.table_stats(partials)["retired"] == stats.partial_chunks


def test_a_new_service_continues_a_response_in_progress_from_its_chunks(client, unique):
    """What a stopped run left in the partials table (two chunks of row 1, generated under version 0) is the
    start of row 1's response, with its logprobs and versions; the rest is generated under version 1."""
    rollout, partials = partial_tables(client, unique)
    client.put(rollout, [0, 1], {cols.PROMPT_IDS: [torch.tensor([5, 6, 7]), torch.tensor([5, 6, 8])]})
    chunks = [([11, 12], [-0.5, -0.25], [0, 0]), ([13], [-1.0], [0])]
    for k, (ids, logprobs, versions) in enumerate(chunks):
        client.put(
            partials,
            [cols.partial_row_id(1, k)],
            {
                cols.PARTIAL_OF: torch.tensor([1]),
                cols.RESPONSE_IDS: [torch.tensor(ids)],
                cols.ROLLOUT_LOGPROBS: [torch.tensor(logprobs)],
                cols.TOKEN_VERSIONS: [torch.tensor(versions)],
            },
        )
    stats = asyncio.run(serve(client, chunked(unique, rollout, partials, 6, 4), 2))
    assert (stats.resumed_rows, stats.resumed_tokens) == (1, 3)
    batch = client.lease(rollout, "check", CHECK, count=2, timeout=5)
    i = batch.row_ids.index(1)
    response = batch.columns[cols.RESPONSE_IDS][i].tolist()
    assert response[:3] == [11, 12, 13] and len(response) >= 4
    assert batch.columns[cols.ROLLOUT_LOGPROBS][i][:3].tolist() == [-0.5, -0.25, -1.0]
    assert batch.columns[cols.TOKEN_VERSIONS][i].tolist() == [0, 0, 0] + [1] * (len(response) - 3)
    assert client.table_stats(partials)["rows"] == 0, "the chunks go once the response is written"


def test_partial_every_without_a_partials_table_is_refused_naming_the_field():
    with pytest.raises(SchemaError, match="InferenceServiceConfig.partial_every: expected 0, or tokens >= 1"):
        InferenceServiceConfig(partial_every=8)


def test_teacher_writes_top_k_at_every_response_position(client, unique):
    name = table(client, unique)
    client.put(name, [0, 1], {cols.PROMPT_IDS: [torch.tensor([5, 6, 7]), torch.tensor([9])]})
    responses = [torch.tensor([10, 11, 12, 13]), torch.zeros(0, dtype=torch.int64)]
    client.add_columns(name, [0, 1], {cols.RESPONSE_IDS: responses})
    e = engine()

    async def serve():
        scored = await TeacherService(client, e, TeacherServiceConfig(table=name, top_k=4)).run(max_rows=2)
        reference = await e.score([5, 6, 7, 10, 11, 12, 13], top_k=4, start=2)
        await e.close()
        return scored, reference

    scored, reference = asyncio.run(serve())
    assert scored == 2
    batch = client.lease(name, "check", [cols.TEACHER_TOPK_IDS, cols.TEACHER_TOPK_LOGPROBS], count=2, timeout=5)
    c = dict(zip(batch.row_ids, range(2), strict=True))
    ids, logprobs = batch.columns[cols.TEACHER_TOPK_IDS][c[0]], batch.columns[cols.TEACHER_TOPK_LOGPROBS][c[0]]
    assert ids.shape == (4, 4) and logprobs.shape == (4, 4)
    assert ids.tolist() == reference.topk_ids and torch.allclose(logprobs, torch.tensor(reference.topk_logprobs))
    assert batch.columns[cols.TEACHER_TOPK_IDS][c[1]].shape == (0, 4)


def test_reference_writes_every_response_token_s_logprob_as_the_policy_it_was_published_from(client, unique, tmp_path):
    policy, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=4)
    published = DirectoryPublisher(tmp_path, ARCH, dtype="float32").publish(policy, 0)  # the policy's version 0
    name = table(client, unique)
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([9]), torch.tensor([5, 6]), torch.tensor([4, 4])]
    responses = [
        torch.tensor([10, 11, 12, 13]),
        torch.tensor([8, 3]),
        torch.zeros(0, dtype=torch.int64),  # nothing to score
        torch.tensor([4, ARCH.vocab_size + 1]),  # the engine refuses it
    ]
    client.put(name, [0, 1, 2, 3], {cols.PROMPT_IDS: prompts})
    client.add_columns(name, [0, 1, 2, 3], {cols.RESPONSE_IDS: responses})
    e = TorchEngine(published, max_running=8, max_len=128)
    service = ReferenceService(client, e, ReferenceServiceConfig(table=name, rows_per_lease=2))

    async def serve():
        try:
            return await service.run(max_rows=4)
        finally:
            await e.close()

    assert asyncio.run(serve()) == 4 and service.unscored == 1
    batch = client.lease(name, "check", [cols.REF_LOGPROBS], count=4, timeout=5)
    ref = dict(zip(batch.row_ids, batch.columns[cols.REF_LOGPROBS], strict=True))
    for row in (0, 1):
        tokens = torch.cat([prompts[row], responses[row]])[None]
        with torch.no_grad():
            expected = token_logprobs(forward_logits(policy, tokens), tokens)[0, len(prompts[row]) - 1 :]
        assert ref[row].dtype == torch.float32 and ref[row].shape == responses[row].shape
        assert torch.allclose(ref[row], expected, atol=1e-5), (ref[row], expected)
        assert kl_to_reference(expected[None], ref[row][None]).max() < 1e-8, "no KL to itself"
    assert ref[2].shape == ref[3].shape == (0,), "rows it cannot score get no entries, so training drops them"


def test_a_scorer_leasing_in_bursts_scores_rows_arriving_apart_in_one_turn_and_takes_fewer_once_it_waited(
    client, unique
):
    name = table(client, unique)
    turns = []

    @contextlib.asynccontextmanager
    async def device_turn():
        turns.append(len(turns))
        yield

    def arrive(rows: list[int]) -> None:
        client.put(name, rows, {cols.PROMPT_IDS: [torch.tensor([5, 6, 7])] * len(rows)})
        client.add_columns(name, rows, {cols.RESPONSE_IDS: [torch.tensor([8, 9])] * len(rows)})

    def scorer(wait_s: float) -> ReferenceService:
        config = ReferenceServiceConfig(table=name, rows_per_lease=4, burst_rows=4, burst_wait_s=wait_s)
        return ReferenceService(client, e, config, device_turn=device_turn)

    e = engine()

    async def serve():
        patient = scorer(wait_s=60.0)
        scoring = asyncio.ensure_future(patient.run(max_rows=4))
        arrive([0, 1])
        await asyncio.sleep(1.0)
        assert turns == [] and not scoring.done(), "two ready rows of a burst of four wait for the rest"
        arrive([2, 3])
        assert await asyncio.wait_for(scoring, timeout=60) == 4
        assert len(turns) == 1, "the four rows were scored in one turn"
        arrive([4, 5])
        assert await asyncio.wait_for(scorer(wait_s=0.3).run(max_rows=2), timeout=60) == 2
        assert len(turns) == 2, "after its wait, a scorer takes the two rows there are, in one turn"
        await e.close()

    asyncio.run(serve())


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"rows_per_lease": 4, "burst_rows": 5}, "burst_rows: expected 1 <= burst_rows <= rows_per_lease (4), got 5"),
        ({"burst_rows": 0}, "burst_rows: expected 1 <= burst_rows <= rows_per_lease (8), got 0"),
        ({"burst_wait_s": -1.0}, "ReferenceServiceConfig.burst_wait_s: expected finite seconds >= 0, got -1.0"),
    ],
)
def test_a_scorer_s_bad_bursts_are_refused_naming_the_field(fields, error):
    with pytest.raises(SchemaError, match=re.escape(error)):
        ReferenceServiceConfig(**fields)


def test_each_row_is_sampled_with_the_service_settings_its_own_budget_and_a_seed_of_its_own():
    settings = SamplingParams(8, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop_token_ids=(2,))
    config = InferenceServiceConfig(sampling=settings)
    row = config.row_sampling(11, 4)
    assert row == SamplingParams(4, 0.7, 0.9, 5, seed=(3 * 1_000_003 + 11) % (1 << 63), stop_token_ids=(2,))
    assert config.row_sampling(12, 4).seed != row.seed
    assert InferenceServiceConfig().row_sampling(11, 4).seed is None, "an unseeded service samples rows unseeded"
