"""torchrun body for the resume test. `train`: 3 policy steps, checkpoint after step 2, then steps 3 and 4.
`resume`: a differently-initialised trainer loads the checkpoint and runs steps 3 and 4. Both record
the losses of steps 3 and 4 (rank 0) to compare bit for bit. Before that, `resume` tries a copy of the
checkpoint with rank 1's file corrupted: both ranks must refuse it, with their trainer untouched.

Arguments: mode, checkpoint root, output file, model name, expert-parallel degree, and "background" to save
with checkpoint.BackgroundSaves (steps 3 and 4 then train while the checkpoint is written)."""

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshy.train import checkpoint
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.process_group import init_process_group
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LossConfig, OptimConfig, ParallelConfig


def batch(step: int, rank: int, vocab: int) -> PolicyBatch:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (2, 10), generator=g)
    mask = torch.zeros(2, 9)
    mask[:, 4:] = 1.0
    rollout = torch.randn(2, 9, generator=g) * 0.01 - 2.0
    return PolicyBatch(tokens, mask, torch.randn(2, generator=g), rollout_logprobs=rollout)


def local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter."""
    return param.detach().to_local() if isinstance(param, DTensor) else param.detach()


def refuse_corrupt_copy(root: Path, trainer: PolicyTrainer, rank: int) -> str:
    """The error both ranks raised for a copy whose __1_0.distcp (checked by rank 0 alone) has a flipped bit."""
    corrupt = root.parent / "corrupt"
    if rank == 0:
        shutil.copytree(checkpoint.latest(root), corrupt)
        data = bytearray((corrupt / "__1_0.distcp").read_bytes())
        data[len(data) // 2] ^= 0x01
        (corrupt / "__1_0.distcp").write_bytes(bytes(data))
    dist.barrier()
    before = [local(p).clone() for p in trainer.model.parameters()]
    try:
        checkpoint.load(corrupt, trainer)
    except checkpoint.CorruptCheckpoint as e:
        after = [local(p) for p in trainer.model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "a refused load changed weights"
        assert trainer.steps == 0, trainer.steps
        return str(e)
    raise AssertionError(f"rank {rank}: the corrupt checkpoint was loaded")


def main() -> None:
    mode, root, out, model_name, ep = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    background = checkpoint.BackgroundSaves(root) if sys.argv[6] == "background" else None
    init_process_group("cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0
    arch = get_model(model_name)
    model, _ = build_model(arch, ParallelConfig(ep=ep), device="cpu", seed=0 if mode == "train" else 99)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-3, warmup_steps=3), LossConfig())
    losses = {}
    if mode == "train":
        for step in (1, 2):
            trainer.step(batch(step, rank, arch.vocab_size))
        cursors = {"version": 2, "weights_reader": "trainer"}
        if background is not None:
            background.save(2, trainer, cursors)
        else:
            checkpoint.save(root, 2, trainer, cursors)
    else:
        refused = refuse_corrupt_copy(Path(root), trainer, rank)
        cursors = checkpoint.load(checkpoint.latest(root), trainer)
        assert cursors == {"version": 2, "weights_reader": "trainer"}, cursors
    for step in (3, 4):
        losses[step] = trainer.step(batch(step, rank, arch.vocab_size))["loss"]
    if background is not None:
        background.close()
    if rank == 0:
        with open(out, "w") as f:
            result = {"losses": losses, "steps": trainer.steps, "lr": trainer.scheduler.get_last_lr()[0]}
            if mode == "resume":
                result["refused"] = refused
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
