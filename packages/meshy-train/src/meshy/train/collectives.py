"""The all-reduce every training service runs over its role's default process group (counts, flags,
metrics, loss parts): one wrapper, so a single process needs no process group."""

import torch
import torch.distributed as dist


def reduce_over_ranks(value: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce in place over the default process group (a no-op in a single process); returns it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=op)
    return value
