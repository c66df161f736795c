import json
import re
import warnings

import pytest
import torch

from meshy.dataplane.weights import CorruptWeights, Published, read_published
from meshy.train.logprobs import forward_logits
from meshy.train.models import get_model
from meshy.train.parallel import ParallelConfig, build_model, load_weights
from meshy.train.publish import DirectoryPublisher, SharedMemoryPublisher


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
            model = arch.titan_config().build()
        unique_params = sum(p.numel() for p in model.parameters())
        stored = unique_params + (arch.vocab_size * arch.hidden_size if arch.tie_word_embeddings else 0)
        assert unique_params == arch.num_parameters(), name
        if name in published:
            assert stored == published[name], name
    assert get_model("minicpm5-1b").num_parameters() == 1_080_632_832
