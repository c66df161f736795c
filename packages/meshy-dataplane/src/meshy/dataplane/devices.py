"""Where tensors live. Rows on the data plane are host tensors (HOST); a role's model, batches and
caches live on its slot's device and are created there, never on torch's default device.

A colocated role hands its GPU token on only after giving the device's memory back (`free_cached`):
moving tensors off a GPU returns their blocks to torch's caching allocator, which keeps them reserved
for this process until they are emptied, so the next holder could not use them.
"""

from pathlib import Path

import torch

HOST = torch.device("cpu")


def free_cached(device: torch.device) -> None:
    """Return the cached, unused memory of `device` to the driver (a no-op off CUDA): the caching
    allocator's free blocks and the cuBLAS workspaces (32 MiB per handle on Hopper)."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


def free_bytes(device: torch.device) -> int | None:
    """Bytes this process could still allocate on `device`: what the driver has free plus what torch's
    caching allocator holds unused (CUDA), or the kernel's estimate of available memory (the host, on
    Linux); None where neither is known."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    if device.type != "cpu":
        return None
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # reported in KiB
    return None
