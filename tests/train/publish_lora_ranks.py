"""torchrun body: two ranks share a LoRA model (FSDP2) and publish two versions of it on disk and in shared
memory; rank 0 saves what it announced and the shared-memory version it reads back. The base is loaded from
the test's file (a sharded model's random init is not one process's); the adapters start as one process's."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshy.dataplane.weights import read_published
from meshy.train.models import get_model
from meshy.train.parallel import build_model, load_weights
from meshy.train.process_group import init_process_group
from meshy.train.publish import DirectoryPublisher, SharedMemoryPublisher
from meshy.train.training_config import LoraConfig, ParallelConfig

LORA = LoraConfig(rank=4, alpha=8.0, targets=("wq", "wv", "w2"))


def lora_model(base: dict[str, torch.Tensor]) -> torch.nn.Module:
    arch = get_model("qwen3-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=3, lora=LORA)
    load_weights(model, arch, base)
    return model


def adapter_step(model: torch.nn.Module, step: int) -> None:
    """Every adapter moves by the same amount, sharded or not (B is no longer zero)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(0.01 * step)


def main() -> None:
    out, prefix = Path(sys.argv[1]), sys.argv[2]
    init_process_group("cpu")
    arch = get_model("qwen3-tiny")
    model = lora_model(torch.load(out / "base.pt"))
    disk = DirectoryPublisher(out / "weights", arch, dtype="float32")
    shared = SharedMemoryPublisher(prefix, arch, dtype="float32")
    announced = []
    for version in (1, 2):
        adapter_step(model, version)
        announced += [disk.publish(model, version), shared.publish(model, version)]
    if dist.get_rank() == 0:
        torch.save(read_published(announced[-1])[1], out / "shared.pt")
        (out / "announced.json").write_text(json.dumps([p.to_message() for p in announced]))
    else:
        assert announced == [None] * 4
    shared.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
