import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshy.train.logprobs import forward_logits, token_logprobs
from meshy.train.models import get_model
from meshy.train.parallel import ParallelConfig, build_model, load_weights
from meshy.train.publish import hf_tensors

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("model_name", ["qwen3-tiny", "minicpm5-tiny"])
def test_two_rank_fsdp_gradients_equal_single_process_gradients(model_name, tmp_path):
    arch = get_model(model_name)
    reference, _ = build_model(arch, ParallelConfig(), seed=3)
    torch.manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (4, 9))
    mask = (torch.rand(4, 8) < 0.7).float()
    weights = dict(hf_tensors(reference, arch, torch.float32))
    torch.save({"weights": weights, "tokens": tokens, "mask": mask}, tmp_path / "inputs.pt")

    logprobs = token_logprobs(forward_logits(reference, tokens), tokens)
    (-(logprobs * mask).sum() / mask.sum()).backward()

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(Path(__file__).with_name("fsdp_grads.py")), model_name, str(tmp_path / "inputs.pt")]
    result = subprocess.run([*cmd, str(tmp_path / "grads.pt")], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    fsdp = torch.load(tmp_path / "grads.pt")
    assert set(fsdp) == {name for name, _ in reference.named_parameters()}
    for name, param in reference.named_parameters():
        error = ((fsdp[name] - param.grad).norm() / param.grad.norm()).item()
        assert error <= 1e-6, f"{name}: relative error {error:.2e}"


def test_weights_load_into_a_model_and_reproduce_it():
    arch = get_model("qwen3-tiny")
    source, _ = build_model(arch, ParallelConfig(), seed=1)
    target, _ = build_model(arch, ParallelConfig(), seed=2)
    tokens = torch.randint(0, arch.vocab_size, (2, 7))
    assert not torch.equal(forward_logits(source, tokens), forward_logits(target, tokens))
    load_weights(target, arch, dict(hf_tensors(source, arch, torch.float32)))
    assert torch.equal(forward_logits(source, tokens), forward_logits(target, tokens))


def test_a_pinned_gpu_overrides_local_rank_and_cpu_stays_cpu(monkeypatch):
    """A launcher pins each role process to its topology's GPU (a critic at rank 8 may own cuda:6);
    without a pin, torchrun's LOCAL_RANK names the GPU; without CUDA, everything is on the CPU."""
    from meshy.train import cpu, parallel

    monkeypatch.setenv("LOCAL_RANK", "8")
    monkeypatch.setattr(parallel, "_pinned", None)
    monkeypatch.setattr(cpu, "on_cpu", lambda: False)
    assert parallel.local_device() == torch.device("cuda", 8)
    parallel.use_device("cuda:6")
    assert parallel.local_device() == torch.device("cuda", 6)
    monkeypatch.setattr(cpu, "on_cpu", lambda: True)
    assert parallel.local_device() == torch.device("cpu")
