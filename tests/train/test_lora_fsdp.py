"""LoRA under FSDP2 on two gloo processes (and with expert parallelism for a mixture's attention): the
adapters shard with their blocks, start as one process's, train as one process's, the base stays as
loaded, only the adapters hold optimizer state, and a checkpoint of them resumes bit for bit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from meshy.train.lora import adapter_tensors, base_tensors
from meshy.train.models import get_model
from meshy.train.parallel import build_model, load_weights
from meshy.train.titan_models import state_dict_adapter
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LossConfig, OptimConfig, ParallelConfig
from tests.train.lora_ranks import COMPARED

REPO = Path(__file__).resolve().parents[2]


def batches(vocab_size: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    made = []
    for _ in range(3):
        mask = (torch.rand(4, 9, generator=g) < 0.7).float()
        tokens = torch.randint(0, vocab_size, (4, 10), generator=g)
        made.append({"tokens": tokens, "mask": mask, "advantages": torch.randn(4, generator=g)})
    return made


def two_ranks(model_name: str, ep: int, tmp_path: Path) -> tuple[dict, dict, torch.nn.Module]:
    """The two-rank run's results, its inputs and the model whose weights it loaded."""
    arch = get_model(model_name)
    reference, _ = build_model(arch, ParallelConfig(), device="cpu", seed=3)
    weights = state_dict_adapter(arch).to_hf(dict(base_tensors(reference)))
    inputs = {"weights": weights, "batches": batches(arch.vocab_size)}
    torch.save(inputs, tmp_path / "inputs.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(Path(__file__).with_name("lora_ranks.py")), model_name, str(ep)]
    cmd += [str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"), str(tmp_path / "checkpoints")]
    result = subprocess.run(
        cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(tmp_path / "out.pt"), inputs, reference


def check(model_name: str, ep: int, tmp_path: Path) -> None:
    saved, inputs, reference = two_ranks(model_name, ep, tmp_path)
    arch = get_model(model_name)

    # One process, the same base, adapters and batches (whole).
    one, _ = build_model(arch, ParallelConfig(), device="cpu", seed=5, lora=COMPARED)
    load_weights(one, arch, inputs["weights"])
    compared = saved["compare"]
    initial = dict(adapter_tensors(one))
    assert initial.keys() == compared["initial"].keys()
    assert all(torch.equal(initial[name], compared["initial"][name]) for name in initial), "the same initial adapters"
    trainer = PolicyTrainer(one, OptimConfig(lr=1e-2), LossConfig(tis="none"))
    for batch in inputs["batches"]:
        trainer.step(PolicyBatch(batch["tokens"], batch["mask"], batch["advantages"]))
    for name, tensor in adapter_tensors(one):
        fsdp = compared["adapters"][name]
        assert not torch.equal(fsdp, compared["initial"][name]), f"{name} did not train"
        error = ((fsdp - tensor).norm() / tensor.norm()).item()
        assert error <= 1e-5, f"{name}: relative error {error:.2e}"

    base = reference.state_dict()
    assert compared["base"].keys() == base.keys()
    assert all(torch.equal(compared["base"][name], base[name]) for name in base), "the base did not move"
    # Each rank: AdamW's step, exp_avg and exp_avg_sq for each of its adapter shards, and nothing else.
    adapters = len(initial)
    assert compared["optimizer"] == [[3 * adapters, adapters]] * 2

    resumed = saved["resume"]
    assert resumed["resumed"] == resumed["trained"]  # losses of steps 3 and 4: identical floats
    assert resumed["adapters"].keys() == resumed["resumed_adapters"].keys() == initial.keys()
    assert all(torch.equal(resumed["adapters"][n], resumed["resumed_adapters"][n]) for n in initial)
    saved_checkpoint = tmp_path / "checkpoints" / "step-00000002"
    model_entries = {
        key.split(".", 1)[1]
        for key in FileSystemReader(str(saved_checkpoint)).read_metadata().state_dict_metadata
        if key.startswith("model.")
    }
    assert model_entries and all(".lora_A." in key or ".lora_B." in key for key in model_entries), "adapters only"


def test_two_rank_fsdp_lora_trains_as_one_process_and_resumes_bit_for_bit(tmp_path):
    check("qwen3-tiny", 1, tmp_path)


@pytest.mark.slow  # two torchrun ranks; the default tier runs the dense model
def test_a_mixtures_attention_adapters_train_with_expert_parallelism(tmp_path):
    """ep = 2: the experts split over the two ranks, the adapters (on attention) sharded with FSDP2."""
    check("qwen3-tiny-moe", 2, tmp_path)
