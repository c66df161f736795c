"""What torchtitan 0.3.0 needs to train on a host without CUDA (gloo instead of NCCL). Applied only there.

1. torchtitan resolves its device at import (`... or "cuda"`) and copies the answer into several
   modules; they are pointed at the CPU.
2. FSDP reduce-scatters gradients with PREMUL_SUM, which gloo rejects; plain SUM is numerically the
   same here, because Meshy's losses are already divided by the global token or sequence count.
"""

import importlib

import torch
from torch.distributed.fsdp import FSDPModule

_DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.components.metrics",
    "torchtitan.tools.profiler",
)


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def use_cpu_device() -> None:
    for name in _DEVICE_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu


def sum_gradient_reduction(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
