"""torchrun body for the 2-rank critic test: each rank builds the critic (backbone and value head sharded
over the ranks), takes one clipped value-loss step on its share of a batch, and rank 0 saves the step's
metrics and the full parameters after it.

Arguments: inputs file, output file."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshy.train.config import OptimConfig, ParallelConfig
from meshy.train.critic import CriticTrainer, ValueBatch, ValueModel
from meshy.train.models import get_model
from meshy.train.parallel import build_model, load_weights
from meshy.train.process_group import init_process_group


def main() -> None:
    inputs, out = sys.argv[1], sys.argv[2]
    init_process_group("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.load(inputs)
    arch = get_model("qwen3-tiny")
    backbone, _ = build_model(arch, ParallelConfig(), device="cpu")
    load_weights(backbone, arch, data["weights"])
    trainer = CriticTrainer(ValueModel(backbone, arch.hidden_size, 0.5), OptimConfig(lr=1e-2), value_clip=0.2)
    share = {k: data[k].chunk(world)[rank] for k in ("tokens", "mask", "returns", "old_values")}
    metrics = trainer.step(ValueBatch(**share))
    params = {}
    for name, param in trainer.model.named_parameters():
        params[name] = param.full_tensor() if isinstance(param, DTensor) else param.detach()
    if rank == 0:
        torch.save({"metrics": metrics, "params": params}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
