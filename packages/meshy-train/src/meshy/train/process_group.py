"""A role's own process group: the default group of each process of a role with several (training ranks
for FSDP, or a role's processes for their own collectives). Roles never run collectives with each other:
they meet on the data plane. No torchtitan here: every role with several processes joins one.
"""

from datetime import timedelta

import torch
import torch.distributed as dist


def init_process_group(
    device: str | torch.device,
    timeout_s: float = 600.0,
    store: dist.Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> None:
    """Join this role's process group, for processes whose tensors live on `device` (their slot's): from
    torchrun-style env (RANK, WORLD_SIZE, MASTER_*), or from a store shared with the role's other processes
    (given with this process's rank and their count)."""
    if dist.is_initialized():
        return
    device = torch.device(device)
    if device.type != "cpu":
        torch.cuda.set_device(device)
    # Autograd's worker threads cannot see the mesh stack torchtitan keeps per thread (for AC).
    torch.autograd.set_multithreading_enabled(False)
    # On GPUs, NCCL for device tensors and gloo for the small host-tensor collectives (counts, flags,
    # metrics) the services run: a process group of NCCL alone refuses CPU tensors.
    backend, timeout = "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl", timedelta(seconds=timeout_s)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout, store=store, rank=rank, world_size=world_size)
