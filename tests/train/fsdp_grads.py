"""torchrun body for the FSDP gradient test: each rank takes its share of one batch, loss divided by
the batch's global token count; rank 0 saves the full gradients. Then each rank takes a policy step
(policy gradient and KL to a reference) on its share, and rank 0 saves the step's metrics.

Arguments: model name, inputs file, output file, expert-parallel degree, data-parallel replicas."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshy.train.logprobs import forward_logits, token_logprobs
from meshy.train.models import get_model
from meshy.train.parallel import build_model, load_weights
from meshy.train.process_group import init_process_group
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LossConfig, OptimConfig, ParallelConfig


def main() -> None:
    model_name, inputs, out, ep, replicas = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    init_process_group("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    arch = get_model(model_name)
    model, _ = build_model(arch, ParallelConfig(ep=ep, dp_replicate=replicas), device="cpu")
    data = torch.load(inputs)
    load_weights(model, arch, data["weights"])
    tokens, mask = data["tokens"].chunk(world)[rank], data["mask"].chunk(world)[rank]
    denominator = data["mask"].sum()
    logprobs = token_logprobs(forward_logits(model, tokens), tokens)
    (-(logprobs * mask).sum() / denominator).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grads[name] = grad
    model.zero_grad(set_to_none=True)
    trainer = PolicyTrainer(model, OptimConfig(), LossConfig(tis="none", kl_coef=0.1))
    advantages, ref_logprobs = data["advantages"].chunk(world)[rank], data["ref_logprobs"].chunk(world)[rank]
    metrics = trainer.step(PolicyBatch(tokens, mask, advantages, ref_logprobs=ref_logprobs))
    if rank == 0:
        torch.save({"grads": grads, "metrics": metrics}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
