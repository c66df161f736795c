"""LoRA versions on every transport (meshy.dataplane.adapters): the base kept once where the transport keeps it,
each version its adapters under PEFT's names, checksummed, and read back or received with or without the base."""

import json
import os
import queue
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from meshy.dataplane.adapters import Adapter, is_adapter_tensor
from meshy.dataplane.hf_directory import HFDirectory
from meshy.dataplane.weight_sync import WeightSyncGroup
from meshy.dataplane.weights import CorruptWeights, Published, read_published, tensors_checksum, verify_published
from meshy.train.logprobs import forward_logits, token_logprobs
from meshy.train.lora import adapter_tensors
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.publish import (
    CollectivePublisher,
    DirectoryPublisher,
    KeepingPublisher,
    SharedMemoryPublisher,
    adapter_specs,
    base_hf_tensors,
    full_hf_tensors,
    hf_specs,
    hf_tensors,
)
from meshy.train.training_config import LoraConfig, ParallelConfig

ARCH = get_model("qwen3-tiny")
REPO = Path(__file__).resolve().parents[2]
TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
HF_TARGETS = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


def lora_model(seed: int = 1, dtype: str = "float32", arch=ARCH, rank: int = 4) -> torch.nn.Module:
    """The trainer's model with adapters on every projection, each B drawn at random (a trained adapter)."""
    model, _ = build_model(
        arch, ParallelConfig(), device="cpu", dtype=dtype, seed=seed, lora=LoraConfig(rank, 8.0, 0.0, TARGETS)
    )
    adapter_step(model, seed, scale=0.1)
    return model


def adapter_step(model: torch.nn.Module, step: int, scale: float = 0.02) -> None:
    """Move every adapter (and only the adapters) as a training step would."""
    g = torch.Generator(device="cpu").manual_seed(1000 + step)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=g, device="cpu"), alpha=scale)


def converted(tensors, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: t.to(dtype) for name, t in tensors}


def expected_adapter(model: torch.nn.Module, dtype: torch.dtype) -> Adapter:
    return Adapter(4, 8.0, HF_TARGETS, tensors_checksum(converted(base_hf_tensors(model, ARCH), dtype)))


def assert_same(tensors: dict, expected: dict) -> None:
    assert tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensors[name], tensor), name


def test_an_adapted_model_is_published_whole_only_merged_never_under_its_adapters_names():
    model = lora_model()
    merged = dict(full_hf_tensors(model, ARCH))
    base = dict(base_hf_tensors(model, ARCH))
    assert merged.keys() == base.keys() and not any("lora" in n or "base_layer" in n for n in merged)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base[q]), "the adapters are merged in"
    assert [(n, d, s) for n, d, s in hf_specs(model, ARCH, torch.bfloat16)] == [
        (n, torch.bfloat16, tuple(t.shape)) for n, t in merged.items()
    ]
    assert adapter_specs(model, ARCH, torch.bfloat16) == [
        (n, torch.bfloat16, tuple(t.shape)) for n, t in adapter_tensors(model)
    ]


def test_disk_lora_versions_are_peft_directories_on_one_base_kept_pruned_and_verified(tmp_path):
    model = lora_model()
    publisher = DirectoryPublisher(tmp_path, ARCH, dtype="bfloat16", keep=2)
    published, expected = {}, {}
    for version in (1, 2, 3):
        adapter_step(model, version)
        published[version] = publisher.publish(model, version)
        expected[version] = converted(adapter_tensors(model), torch.bfloat16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "v000002", "v000003"]
    assert sorted(p.name for p in (tmp_path / "v000003").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    latest = published[3]
    assert latest.adapter == expected_adapter(model, torch.bfloat16)
    assert latest.checksum == tensors_checksum(expected[3]) and latest.location == str(tmp_path / "v000003")
    assert Published.from_message(latest.to_message()) == latest
    config = json.loads((tmp_path / "v000003" / "adapter_config.json").read_text())
    assert config == latest.adapter.peft_config(str(tmp_path / "base"))

    base = converted(base_hf_tensors(model, ARCH), torch.bfloat16)
    config, tensors = read_published(latest)
    assert config == ARCH.hf_config("bfloat16")
    assert_same(tensors, {**base, **expected[3]})
    assert_same(read_published(latest, held_base=latest.adapter.base)[1], expected[3])
    directory, _, shapes = verify_published(latest)
    assert directory.path == tmp_path / "base" and shapes == {n: tuple(t.shape) for n, t in base.items()}

    whole = DirectoryPublisher(tmp_path / "whole", ARCH, dtype="bfloat16", adapters=False).publish(model, 3)
    assert whole.adapter is None
    assert_same(read_published(whole)[1], converted(full_hf_tensors(model, ARCH), torch.bfloat16))
    share = latest.num_bytes / whole.num_bytes
    assert share < 0.25, f"an adapter version of the tiny model is {share:.0%} of a whole one"

    weights = tmp_path / "v000003" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptWeights, match=r"weights v3 at .*/v000003: checksum mismatch"):
        read_published(latest)
    shard = tmp_path / "base" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptWeights, match=r"weights v2: its base at .*/base: checksum mismatch \(announced: "):
        read_published(published[2])
    with pytest.raises(CorruptWeights, match=r"weights v2: its base at .*/base: checksum mismatch"):
        verify_published(published[2])
    assert_same(read_published(published[2], held_base=latest.adapter.base)[1], expected[2]), "the base is not read"


def test_a_disk_base_already_there_is_kept_when_it_holds_the_same_tensors_and_replaced_otherwise(tmp_path):
    model = lora_model()
    first = DirectoryPublisher(tmp_path, ARCH, dtype="float32").publish(model, 1)
    inode = (tmp_path / "base" / "model.safetensors").stat().st_ino
    again = DirectoryPublisher(tmp_path, ARCH, dtype="float32").publish(model, 2)  # a resumed run
    assert again.adapter.base == first.adapter.base
    assert (tmp_path / "base" / "model.safetensors").stat().st_ino == inode
    other = DirectoryPublisher(tmp_path, ARCH, dtype="float32").publish(lora_model(seed=2), 3)
    assert other.adapter.base != first.adapter.base
    _, tensors = read_published(other)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no temporaries left"
    with pytest.raises(CorruptWeights, match="weights v2: its base at"):
        read_published(again)  # it applied onto the base that was replaced
    assert tensors.keys() > {n for n in tensors if is_adapter_tensor(n)}


@pytest.mark.parametrize("damage", ["config", "weights"])
def test_a_disk_lora_version_whose_files_disagree_with_its_announcement_is_corrupt(tmp_path, damage):
    published = DirectoryPublisher(tmp_path, ARCH, dtype="float32").publish(lora_model(), 1)
    directory = Path(published.location)
    if damage == "config":
        config = json.loads((directory / "adapter_config.json").read_text())
        (directory / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
        error = "weights v1 at .*/v000001: adapter_config.json has r 8, the announcement 4"
    else:
        (directory / "adapter_model.safetensors").unlink()
        error = "weights v1: adapter source .*/v000001: no adapter_model.safetensors; expected a PEFT adapter directory"
    with pytest.raises(CorruptWeights, match=error):
        read_published(published)


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-5), ("bfloat16", 0.02)])
def test_peft_loads_a_published_version_onto_transformers_with_the_trainers_logprobs(dtype, tolerance, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = lora_model(dtype=dtype)
    published = DirectoryPublisher(tmp_path, ARCH, dtype=dtype).publish(model, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=getattr(torch, dtype))
        peft_model = PeftModel.from_pretrained(hf, published.location).eval()
    tokens = torch.randint(0, ARCH.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = token_logprobs(forward_logits(model, tokens).float(), tokens)
        theirs = token_logprobs(peft_model(tokens[:, :-1]).logits.float(), tokens)
        with peft_model.disable_adapter():
            base = token_logprobs(peft_model(tokens[:, :-1]).logits.float(), tokens)
    assert (ours - theirs).abs().max().item() <= tolerance
    assert (ours - base).abs().max().item() > 0.3, "the adapters change the logprobs"


def test_shared_memory_lora_versions_hold_the_adapters_beside_one_base_kept_until_close(unique):
    model = lora_model()
    publisher = SharedMemoryPublisher(unique("meshy-test"), ARCH, dtype="float32", bucket_bytes=50_000, keep=1)
    first = publisher.publish(model, 1)
    adapter_step(model, 2)
    second = publisher.publish(model, 2)
    meta = json.loads(second.location)
    assert meta["base"] == json.loads(first.location)["base"] and len(meta["base"]["buckets"]) > 1
    assert all(is_adapter_tensor(entry["name"]) for entry in meta["tensors"])
    assert second.adapter == expected_adapter(model, torch.float32)
    with pytest.raises(CorruptWeights, match="bucket gone"):
        read_published(first)  # keep=1: its adapters were unlinked, the base stays
    adapters = converted(adapter_tensors(model), torch.float32)
    base = converted(base_hf_tensors(model, ARCH), torch.float32)
    assert_same(read_published(second)[1], {**base, **adapters})
    assert_same(read_published(second, held_base=second.adapter.base)[1], adapters)
    assert second.num_bytes < 0.25 * sum(meta["base"]["buckets"].values())

    from multiprocessing import shared_memory

    bucket = shared_memory.SharedMemory(name=sorted(meta["base"]["buckets"])[0])
    bucket.buf[7] ^= 0xFF
    with pytest.raises(CorruptWeights, match=r"weights v2: its base \(shared-memory\): checksum mismatch"):
        read_published(second)
    assert_same(read_published(second, held_base=second.adapter.base)[1], adapters)
    bucket.buf[7] ^= 0xFF
    bucket.close()
    publisher.close()
    with pytest.raises(CorruptWeights, match="bucket gone"):
        read_published(second)


class Announcements:
    """The `weights` stream and its resync stream, for a publisher and one receiver on two threads."""

    def __init__(self):
        self.messages: queue.Queue = queue.Queue()
        self.requests: list = []

    def append(self, stream: str, payload: dict) -> int:
        (self.requests.append if stream.endswith("-resync") else self.messages.put)(payload)
        return 0

    def reader(self, stream: str, name: str, start: str) -> SimpleNamespace:
        def read(max_n: int) -> list:
            asked, self.requests[:] = list(self.requests), []
            return [SimpleNamespace(payload=p) for p in asked]

        return SimpleNamespace(read=read)


def run_collective(model, publisher_args: dict, versions: int, held: dict, corrupt: int | None = None) -> dict:
    """Publish `versions` LoRA versions on a real gloo group to an engine thread, which receives each holding
    the base it last received (or, for a version in `held`, the base `held` names) and asks for a whole version
    when one is refused; {version: (published, tensors or the error)}, and what the trainer had."""
    store, stream, received = dist.HashStore(), Announcements(), {}

    def engine() -> None:
        group, base = WeightSyncGroup(store, 1, 2, timeout_s=60), None
        for _ in range(versions):
            published = Published.from_message(stream.messages.get(timeout=60))
            try:
                tensors = group.receive(published, held_base=held.get(published.version, base))[1]
                if any(not is_adapter_tensor(n) for n in tensors):
                    base = published.adapter.base
                received[published.version] = (published, {n: t.clone() for n, t in tensors.items()})
            except CorruptWeights as e:
                received[published.version] = (published, str(e))
                stream.append("weights-resync", {"engine": "e", "version": published.version, "error": str(e)})

    thread = threading.Thread(target=engine)
    thread.start()
    group = WeightSyncGroup(store, 0, 2, timeout_s=60)
    publisher = CollectivePublisher(group, ARCH, stream, dtype="bfloat16", bucket_bytes=20_000, **publisher_args)
    if corrupt is not None:
        send = group.send

        def send_flipped(published, buffers):
            if published.version == corrupt:
                next(reversed(buffers.values()))[-1] ^= 0xFF  # the last adapter bucket's last byte
            send(published, buffers)

        group.send = send_flipped
    expected = {}
    for version in range(versions):
        if version:
            adapter_step(model, version, scale=1e-3)
        expected[version] = converted(adapter_tensors(model), torch.bfloat16)
        publisher.publish(model, version)
        while version not in received and thread.is_alive():  # the engine asks before the next version
            thread.join(0.01)
    thread.join(60)
    return received, expected


def test_collective_lora_versions_carry_the_base_first_and_when_asked_and_adapter_deltas_otherwise():
    model = lora_model()
    base = converted(base_hf_tensors(model, ARCH), torch.bfloat16)
    received, expected = run_collective(model, {"delta": True, "full_every": 4}, 6, held={2: None})
    kinds = {}
    for version, (published, tensors) in received.items():
        meta = json.loads(published.location)
        kinds[version] = "base" if "base-b0" in meta["buckets"] else "delta" if "delta" in meta else "adapters"
        assert published.adapter == Adapter(4, 8.0, HF_TARGETS, tensors_checksum(base))
        if isinstance(tensors, str):
            continue
        assert_same(tensors, {**base, **expected[version]} if kinds[version] == "base" else expected[version])
    # v2: this engine held no base; it asked, and v3 carried the base again; v4 is the full_every-th
    assert kinds == {0: "base", 1: "delta", 2: "delta", 3: "base", 4: "delta", 5: "delta"}
    assert received[2][1] == (
        f"weights v2: adapters on base {received[2][0].adapter.base}, and this engine holds no base; it needs a "
        "version that carries the base"
    )
    whole = received[0][0].num_bytes
    assert received[1][0].num_bytes < 0.25 * whole and received[4][0].num_bytes < 0.25 * whole


def test_collective_lora_versions_go_whole_adapters_only_after_the_first_and_corrupt_ones_are_refused():
    model = lora_model()
    base = converted(base_hf_tensors(model, ARCH), torch.bfloat16)
    received, expected = run_collective(model, {}, 5, held={}, corrupt=2)
    carried = {
        v: any(b.startswith("base-b") for b in json.loads(p.location)["buckets"]) for v, (p, _) in received.items()
    }
    assert carried == {0: True, 1: False, 2: False, 3: True, 4: False}, "the base again once the engine asked"
    assert received[2][1] == "weights v2 (collective): checksum mismatch"
    for version in (0, 1, 3, 4):
        assert_same(received[version][1], {**base, **expected[version]} if carried[version] else expected[version])
    assert received[1][0].num_bytes < 0.25 * received[0][0].num_bytes


@pytest.mark.parametrize("transport", ["disk", "shared-memory"])
def test_kept_lora_versions_are_adapter_directories_on_a_base_beside_them(tmp_path, unique, transport):
    model = lora_model()
    if transport == "disk":
        inner = DirectoryPublisher(tmp_path / "weights", ARCH, dtype="bfloat16", keep=1)
    else:
        inner = SharedMemoryPublisher(unique("meshy-test"), ARCH, dtype="bfloat16", keep=1)
    stream = Announcements()
    publisher = KeepingPublisher(inner, 2, tmp_path / "kept", ARCH, "bfloat16", client=stream, stream="eval")
    live = {}
    for version in range(4):
        adapter_step(model, version)
        live[version] = publisher.publish(model, version)
    kept = [Published.from_message(stream.messages.get_nowait()) for _ in range(2)]
    assert [p.location for p in kept] == [str(tmp_path / "kept" / f"v{v:06d}") for v in (0, 2)]
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["base", "v000000", "v000002"]
    assert [p.checksum for p in kept] == [live[0].checksum, live[2].checksum]
    config = json.loads((tmp_path / "kept" / "v000002" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "kept" / "base")
    _, tensors = read_published(kept[1])
    assert_same(
        tensors,
        {
            **converted(base_hf_tensors(model, ARCH), torch.bfloat16),
            **load_file(Path(kept[1].location) / "adapter_model.safetensors"),
        },
    )
    if transport == "disk":  # linked, not copied; and still there once the transport pruned its own copy
        kept_base, live_base = (tmp_path / where / "base" / "model.safetensors" for where in ("kept", "weights"))
        assert kept_base.stat().st_ino == live_base.stat().st_ino
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["base", "v000003"]
    else:
        inner.close()
    assert HFDirectory.open(tmp_path / "kept" / "base").config() == ARCH.hf_config("bfloat16")


def test_a_publisher_without_adapters_publishes_an_adapted_model_merged_on_every_transport(tmp_path, unique):
    model = lora_model()
    merged = dict(hf_tensors(model, ARCH, torch.float32))
    disk = DirectoryPublisher(tmp_path, ARCH, dtype="float32", adapters=False).publish(model, 1)
    shm_publisher = SharedMemoryPublisher(unique("meshy-test"), ARCH, dtype="float32", adapters=False)
    shared = shm_publisher.publish(model, 1)
    try:
        for published in (disk, shared):
            assert published.adapter is None
            assert_same(read_published(published)[1], merged)
    finally:
        shm_publisher.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001"]


@pytest.mark.slow
def test_two_fsdp_ranks_publish_the_lora_versions_one_process_does(tmp_path, unique):
    """Every rank joins the gathers of the base (once) and of the adapters; rank 0 writes what one process
    with the same model would."""
    from tests.train.publish_lora_ranks import adapter_step, lora_model

    base = dict(base_hf_tensors(build_model(ARCH, ParallelConfig(), device="cpu", seed=7)[0], ARCH))
    torch.save(base, tmp_path / "base.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(Path(__file__).with_name("publish_lora_ranks.py")), str(tmp_path), unique("meshy-test")]
    result = subprocess.run(
        cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    announced = [Published.from_message(m) for m in json.loads((tmp_path / "announced.json").read_text())]

    model = lora_model(base)
    one = DirectoryPublisher(tmp_path / "one", ARCH, dtype="float32")
    for version in (1, 2):
        adapter_step(model, version)
        expected = one.publish(model, version)
        for published in announced[2 * version - 2 : 2 * version]:
            assert (published.version, published.checksum, published.adapter) == (
                version,
                expected.checksum,
                expected.adapter,
            )
    assert_same(read_published(announced[2])[1], read_published(expected)[1])
    assert_same(torch.load(tmp_path / "shared.pt"), read_published(expected)[1])
