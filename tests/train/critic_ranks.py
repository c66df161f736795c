"""torchrun body for the 2-rank critic test: each rank builds the critic (backbone and value head sharded
over the ranks), takes one clipped value-loss step on its share of a batch, and rank 0 saves the step's
metrics and the full parameters after it. Then the ranks checkpoint the critic, restore it into a critic
built from another seed, and both take a second step: rank 0 saves both steps' metrics.

Arguments: inputs file, output file, checkpoint root, data-parallel replicas."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshy.train import checkpoint
from meshy.train.critic_service import CriticTrainer, ValueBatch, ValueModel
from meshy.train.models import get_model
from meshy.train.parallel import build_model, load_weights
from meshy.train.process_group import init_process_group
from meshy.train.training_config import OptimConfig, ParallelConfig


def critic(seed: int, replicas: int) -> CriticTrainer:
    arch = get_model("qwen3-tiny")
    backbone, _ = build_model(arch, ParallelConfig(dp_replicate=replicas), device="cpu", seed=seed)
    return CriticTrainer(ValueModel(backbone, arch.hidden_size, 0.5), OptimConfig(lr=1e-2), value_clip=0.2)


def main() -> None:
    inputs, out, root, replicas = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    init_process_group("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.load(inputs)
    trainer = critic(seed=0, replicas=replicas)
    load_weights(trainer.model.backbone, get_model("qwen3-tiny"), data["weights"])
    batch = ValueBatch(**{k: data[k].chunk(world)[rank] for k in ("tokens", "mask", "returns", "old_values")})
    metrics = trainer.step(batch)
    params = {}
    for name, param in trainer.model.named_parameters():
        # a copy: full_tensor() of a parameter no rank shares (one shard) is a view the next step changes
        params[name] = (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
    restored = critic(seed=1, replicas=replicas)
    checkpoint.load(checkpoint.save(root, 1, trainer, {}), restored)
    second = [trainer.step(batch), restored.step(batch)]
    if rank == 0:
        torch.save({"metrics": metrics, "params": params, "second": second}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
