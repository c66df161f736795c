import json
import queue
import re
import threading
import time
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from meshy.dataplane import SchemaError, weights
from meshy.dataplane.hf_directory import HFDirectory
from meshy.dataplane.weight_sync import WeightSyncGroup
from meshy.dataplane.weights import (
    BucketLayout,
    CorruptWeights,
    Published,
    Transport,
    read_published,
    tensors_checksum,
    unpack_buckets,
)
from meshy.train.logprobs import forward_logits
from meshy.train.models import get_model
from meshy.train.parallel import build_model, load_weights
from meshy.train.publish import (
    CollectivePublisher,
    DirectoryPublisher,
    KeepingPublisher,
    SharedMemoryPublisher,
    full_hf_tensors,
    hf_specs,
    hf_tensors,
    pack_version,
)
from meshy.train.titan_models import titan_config
from meshy.train.training_config import ParallelConfig


@pytest.mark.parametrize(
    ("model_name", "hf_class"), [("qwen3-tiny", "Qwen3ForCausalLM"), ("minicpm5-tiny", "LlamaForCausalLM")]
)
def test_published_weights_load_in_transformers_with_the_trainers_logits(model_name, hf_class, tmp_path):
    from transformers import AutoModelForCausalLM

    arch = get_model(model_name)
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=5)
    published = DirectoryPublisher(tmp_path, arch, dtype="float32").publish(model, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(published.location, dtype=torch.float32)
    assert type(hf).__name__ == hf_class
    tokens = torch.randint(0, arch.vocab_size, (3, 17))
    with torch.no_grad():
        ours = forward_logits(model, tokens)
        theirs = hf(tokens[:, :-1]).logits.float()
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_sharded_versions_are_atomic_announced_pruned_and_verified(client, unique, tmp_path):
    arch = get_model("minicpm5-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=1)
    stream = unique("weights")
    reader = client.reader(stream, "engine", start=1)
    publisher = DirectoryPublisher(
        tmp_path, arch, client=client, dtype="float32", max_shard_bytes=100_000, keep=2, stream=stream
    )
    for version in (1, 2, 3):
        publisher.publish(model, version)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000003"]  # pruned, no temporaries left
    announced = [Published.from_message(m.payload) for m in reader.read()]
    assert [p.version for p in announced] == [1, 2, 3] and reader.audit.clean
    latest = announced[-1]
    index = json.loads((tmp_path / "v000003" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    config, tensors = read_published(latest)
    assert config["architectures"] == ["LlamaForCausalLM"]
    target, _ = build_model(arch, ParallelConfig(), device="cpu", seed=2)
    load_weights(target, arch, tensors)
    tokens = torch.randint(0, arch.vocab_size, (2, 9))
    assert torch.equal(forward_logits(target, tokens), forward_logits(model, tokens))

    shard = sorted((tmp_path / "v000003").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # one flipped bit pattern in the last tensor's bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptWeights, match="v3 at .*: checksum mismatch"):
        read_published(latest)
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(
        CorruptWeights, match=r"v3: model source .*/model-00001-of-0000.\.safetensors: not a readable safetensors file"
    ):
        read_published(latest)


@pytest.mark.parametrize("damage", ["torn", "missing"])
def test_a_published_config_json_outside_the_checksum_is_still_checked(tmp_path, damage):
    arch = get_model("qwen3-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=1)
    published = DirectoryPublisher(tmp_path, arch, dtype="float32").publish(model, 4)
    config = tmp_path / "v000004" / "config.json"
    if damage == "torn":
        config.write_text(config.read_text()[:40])
        error = f"weights v4: model source {config}: not valid JSON"
    else:
        config.unlink()
        error = f"weights v4: model source {config.parent}: no config.json"
    with pytest.raises(CorruptWeights, match=re.escape(error)):
        read_published(published)


def test_shared_memory_versions_round_trip_and_are_unlinked(unique):
    arch = get_model("qwen3-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=4)
    publisher = SharedMemoryPublisher(unique("meshy-test"), arch, dtype="float32", bucket_bytes=50_000, keep=1)
    first = publisher.publish(model, 1)
    second = publisher.publish(model, 2)
    assert len(json.loads(second.location)["buckets"]) > 1
    with pytest.raises(CorruptWeights, match="bucket gone"):
        read_published(first)  # keep=1: version 1 was unlinked when version 2 arrived
    _, tensors = read_published(second)
    target, _ = build_model(arch, ParallelConfig(), device="cpu", seed=9)
    load_weights(target, arch, tensors)
    tokens = torch.randint(0, arch.vocab_size, (2, 6))
    assert torch.equal(forward_logits(target, tokens), forward_logits(model, tokens))
    publisher.close()
    with pytest.raises(CorruptWeights):
        read_published(second)


@pytest.mark.parametrize("transport", ["disk", "shared-memory"])
def test_every_nth_version_is_kept_as_an_hf_directory_whatever_the_transport(tmp_path, unique, transport):
    arch = get_model("qwen3-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=4)
    if transport == "disk":
        inner = DirectoryPublisher(tmp_path / "weights", arch, dtype="bfloat16", keep=1)
    else:
        inner = SharedMemoryPublisher(unique("meshy-test"), arch, dtype="bfloat16", keep=1)
    publisher = KeepingPublisher(inner, 2, tmp_path / "kept", arch, "bfloat16")
    expected = {}
    for version in range(5):
        rl_step(model, version + 1)
        expected[version] = dict(hf_tensors(model, arch, torch.bfloat16))
        published = publisher.publish(model, version)
        assert published.version == version and published.transport == Transport(transport)
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["v000000", "v000002", "v000004"]
    for version in (0, 2, 4):
        tensors = dict(HFDirectory.open(tmp_path / "kept" / f"v{version:06d}").tensors())
        assert tensors.keys() == expected[version].keys()
        assert all(torch.equal(tensors[n], t) for n, t in expected[version].items()), version
    if transport == "disk":  # linked, not copied; and still there once the transport pruned its own copy
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000004"]
        kept, live = (tmp_path / where / "v000004" / "model.safetensors" for where in ("kept", "weights"))
        assert kept.stat().st_ino == live.stat().st_ino
    else:
        inner.close()
    with pytest.raises(SchemaError, match="hf_every: expected versions >= 1 between kept versions, got 0"):
        KeepingPublisher(inner, 0, tmp_path / "kept", arch, "bfloat16")


def test_a_kept_disk_version_is_announced_where_it_is_kept(client, unique, tmp_path):
    arch = get_model("qwen3-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=4)
    stream = unique("kept")
    reader = client.reader(stream, "eval", start=1)
    inner = DirectoryPublisher(tmp_path / "weights", arch, dtype="float32")
    publisher = KeepingPublisher(inner, 2, tmp_path / "kept", arch, "float32", client=client, stream=stream)
    live = [publisher.publish(model, version) for version in range(3)]
    kept = [Published.from_message(m.payload) for m in reader.read()]
    assert [(p.version, p.location) for p in kept] == [(v, str(tmp_path / "kept" / f"v{v:06d}")) for v in (0, 2)]
    assert [p.checksum for p in kept] == [live[0].checksum, live[2].checksum]
    assert read_published(kept[-1])[1].keys() == dict(hf_tensors(model, arch, torch.float32)).keys()


@pytest.mark.parametrize("model_name", ["qwen3-tiny", "qwen3-tiny-moe", "minicpm5-tiny"])
def test_the_buckets_are_planned_from_shapes_alone_as_the_gathered_tensors_come(model_name):
    """Collective and shared-memory publishing lay a version out before gathering it: the names and shapes
    the adapter gives for meta tensors must be those of the gathered tensors, in order (MoE experts split)."""
    arch = get_model(model_name)
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=0)
    gathered = [(name, torch.bfloat16, tuple(t.shape)) for name, t in full_hf_tensors(model, arch)]
    assert hf_specs(model, arch, torch.bfloat16) == gathered


def test_a_packed_version_holds_and_hashes_the_converted_tensors_chunk_by_chunk(monkeypatch):
    """Packing converts and hashes each tensor chunk by chunk: the buckets and the checksum must
    be those of the whole tensors converted at once, for tensors of one chunk, of many, and of none."""
    monkeypatch.setattr(weights, "_CHUNK_BYTES", 1000)  # the tiny model's tensors span up to ~100 chunks
    arch = get_model("qwen3-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=3)
    extra = [
        ("transposed", torch.arange(12.0, device="cpu").view(3, 4).t()),
        ("empty", torch.zeros(0, 5, device="cpu")),
    ]
    expected = {n: t.to(torch.bfloat16) for n, t in [*full_hf_tensors(model, arch), *extra]}
    layout = BucketLayout.plan([(n, t.dtype, tuple(t.shape)) for n, t in expected.items()], 50_000)
    buffers = layout.allocate()
    checksum = pack_version(layout, buffers, iter([*full_hf_tensors(model, arch), *extra]), "test")
    assert checksum == tensors_checksum(expected)
    packed = unpack_buckets(layout.manifest, buffers)
    assert all(torch.equal(packed[n], t) for n, t in expected.items())
    with pytest.raises(SchemaError, match=r"'stray': shape \(2,\) is not in the buckets' layout \(absent\)"):
        pack_version(
            layout, buffers, iter([*full_hf_tensors(model, arch), ("stray", torch.ones(2, device="cpu"))]), "test"
        )
    with pytest.raises(SchemaError, match="test: the model lacks tensors of the layout: \\['empty', 'transposed'\\]"):
        pack_version(layout, buffers, full_hf_tensors(model, arch), "test")


def test_meta_instantiation_gives_the_published_parameter_counts():
    published = {  # HF Hub figures; tied models list lm_head among the stored tensors
        "qwen3-1.7b": 2_031_739_904,
        "qwen3-8b": 8_190_735_360,
        "qwen3-30b-a3b": 30_532_122_624,
        "minicpm5-2b": 2_516_756_480,
        "minicpm5-2.6b": 2_516_756_480,
    }
    for name in ("qwen3-1.7b", "qwen3-8b", "qwen3-30b-a3b", "minicpm5-1b", "minicpm5-2b", "minicpm5-2.6b"):
        arch = get_model(name)
        with torch.device("meta"):
            model = titan_config(arch).build()
        unique_params = sum(p.numel() for p in model.parameters())
        stored = unique_params + (arch.vocab_size * arch.hidden_size if arch.tie_word_embeddings else 0)
        assert unique_params == arch.num_parameters(), name
        if name in published:
            assert stored == published[name], name
    assert get_model("minicpm5-1b").num_parameters() == 1_080_632_832


class Announcements:
    """The `weights` stream, for a publisher and one receiver on two threads of this process."""

    def __init__(self):
        self.messages: queue.Queue = queue.Queue()

    def append(self, stream: str, payload: dict) -> int:
        self.messages.put(payload)
        return 0

    def reader(self, stream: str, name: str, start: str) -> SimpleNamespace:
        """The resync stream: no engine asks for a whole version here (tests/infer/test_services does)."""
        return SimpleNamespace(read=lambda max_n: [])


def rl_step(model: torch.nn.Module, step: int) -> None:
    """What one RL step at lr 1e-6 does to the weights: each moves by about the learning rate."""
    g = torch.Generator(device="cpu").manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cpu").sign(), alpha=1e-6)


def test_collective_deltas_rebuild_every_version_bit_for_bit_and_send_a_full_one_every_full_every():
    """A publisher and an engine on a real gloo weight-sync group (two threads): v0 whole, then deltas
    after RL-sized steps, v3 whole again (full_every = 3); each version the engine gets is the trainer's,
    bit for bit, and a delta moves a fraction of the bytes."""
    arch = get_model("qwen3-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=3)
    store = dist.HashStore()
    stream, received, places, errors = Announcements(), {}, {}, []
    engine_group: list[WeightSyncGroup] = []

    def engine() -> None:
        engine_group.append(WeightSyncGroup(store, 1, 2, timeout_s=60))
        for _ in range(5):
            published = Published.from_message(stream.messages.get(timeout=60))
            try:
                tensors = engine_group[0].receive(published)[1]  # views, valid until the next receive
                places[published.version] = {name: t.data_ptr() for name, t in tensors.items()}
                received[published.version] = (published, {name: t.clone() for name, t in tensors.items()})
            except CorruptWeights as e:
                errors.append(str(e))

    thread = threading.Thread(target=engine)
    thread.start()
    publisher = CollectivePublisher(
        WeightSyncGroup(store, 0, 2, timeout_s=60), arch, stream, dtype="bfloat16", delta=True, full_every=3
    )
    expected = {}
    for version in range(5):
        if version:
            rl_step(model, version)
        expected[version] = dict(hf_tensors(model, arch, torch.bfloat16))
        if version == 4:  # as if this engine had missed v3: the delta on v3 cannot be applied
            deadline = time.monotonic() + 60
            while 3 not in received and time.monotonic() < deadline:
                time.sleep(0.01)
            thread_base = engine_group[0]._base_version
            engine_group[0]._base_version = 2
        publisher.publish(model, version)
    thread.join(60)
    assert errors == ["weights v4: a delta on v3, and this engine holds v2; it waits for the next full version"]
    assert thread_base == 3
    assert sorted(received) == [0, 1, 2, 3]
    assert places[0] == places[1] == places[2] == places[3], "every version lands in the same buffers"
    kinds = {v: "delta" in json.loads(p.location) for v, (p, _) in received.items()}
    assert kinds == {0: False, 1: True, 2: True, 3: False}
    for version, (published, tensors) in received.items():
        assert list(tensors) == list(expected[version])
        for name, tensor in expected[version].items():
            assert torch.equal(tensors[name].view(torch.int16), tensor.view(torch.int16)), (version, name)
        if kinds[version]:
            assert published.num_bytes < 0.5 * received[0][0].num_bytes, "a delta after an RL step is small"
