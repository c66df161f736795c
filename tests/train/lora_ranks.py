"""torchrun body for the FSDP LoRA tests, on two CPU ranks.

`compare`: a LoRA model (base loaded from the inputs' weights, adapters from seed 5) takes three policy steps,
each rank on its share of each batch; rank 0 saves the adapters before and after, the base after, and each
rank's count of optimizer state tensors. `resume`: a LoRA model with adapter dropout takes steps 1 and 2,
is checkpointed, takes steps 3 and 4; a second model built anew (the same base, other adapters) loads the
checkpoint and takes steps 3 and 4; rank 0 saves both runs' losses and adapters.

Arguments: model name, expert-parallel degree, inputs file, output file, checkpoint root."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshy.train import checkpoint
from meshy.train.lora import adapter_tensors, base_tensors
from meshy.train.models import get_model
from meshy.train.parallel import build_model, load_weights
from meshy.train.process_group import init_process_group
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LoraConfig, LossConfig, OptimConfig, ParallelConfig

TARGETS = ("wq", "wv", "wo")
COMPARED = LoraConfig(rank=4, alpha=8.0, targets=TARGETS)
RESUMED = LoraConfig(rank=4, alpha=8.0, dropout=0.1, targets=TARGETS)


def share(batch: dict[str, torch.Tensor], rank: int, world: int) -> PolicyBatch:
    return PolicyBatch(*(batch[key].chunk(world)[rank] for key in ("tokens", "mask", "advantages")))


def lora_model(arch, ep: int, weights: dict, lora: LoraConfig, seed: int) -> torch.nn.Module:
    model, _ = build_model(arch, ParallelConfig(ep=ep), device="cpu", seed=seed, lora=lora)
    load_weights(model, arch, weights)
    return model


def compare(arch, ep: int, data: dict, rank: int, world: int) -> dict:
    model = lora_model(arch, ep, data["weights"], COMPARED, seed=5)
    initial = dict(adapter_tensors(model))
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig(tis="none"))
    for batch in data["batches"]:
        assert trainer.step(share(batch, rank, world))["stepped"] == 1.0
    counts = [sum(map(len, trainer.optimizer.state.values())), len(trainer.optimizer.param_groups[0]["params"])]
    counts = torch.tensor(counts)
    all_counts = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts)
    adapters, base = dict(adapter_tensors(model)), dict(base_tensors(model))
    return {"initial": initial, "adapters": adapters, "base": base, "optimizer": [c.tolist() for c in all_counts]}


def lora_trainer(arch, ep: int, weights: dict, seed: int) -> PolicyTrainer:
    """A trainer of a LoRA model with adapter dropout, its base `weights`, its adapters from `seed`."""
    return PolicyTrainer(lora_model(arch, ep, weights, RESUMED, seed), OptimConfig(lr=1e-2), LossConfig(tis="none"))


def resume(arch, ep: int, data: dict, rank: int, world: int, root: Path) -> dict:
    batches = data["batches"] + data["batches"][:1]
    trainer = PolicyTrainer(
        lora_model(arch, ep, data["weights"], RESUMED, seed=0), OptimConfig(lr=1e-2), LossConfig(tis="none")
    )
    for batch in batches[:2]:
        trainer.step(share(batch, rank, world))
    checkpoint.save(root, 2, trainer, {"version": 2})
    trained = [trainer.step(share(batch, rank, world))["loss"] for batch in batches[2:]]
    anew = PolicyTrainer(
        lora_model(arch, ep, data["weights"], RESUMED, seed=99), OptimConfig(lr=1e-2), LossConfig(tis="none")
    )
    assert checkpoint.load(checkpoint.latest(root), anew) == {"version": 2}
    resumed = [anew.step(share(batch, rank, world))["loss"] for batch in batches[2:]]
    return {
        "trained": trained,
        "resumed": resumed,
        "adapters": dict(adapter_tensors(trainer.model)),
        "resumed_adapters": dict(adapter_tensors(anew.model)),
    }


def main() -> None:
    model_name, ep, inputs, out, root = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5])
    init_process_group("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    arch = get_model(model_name)
    data = torch.load(inputs)
    result = {"compare": compare(arch, ep, data, rank, world), "resume": resume(arch, ep, data, rank, world, root)}
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
