"""Moving a trainer between devices: what a colocated trainer does when it hands its GPU over (to host
memory) and takes it back. Parameters, gradients and optimizer state all move; the caller then gives
the freed device memory back (`meshy.dataplane.free_cached`) before granting the token on."""

import torch

from meshy.train.checkpoint import Trainer


def move(trainer: Trainer, device: torch.device) -> None:
    """Parameters and buffers, gradients and the optimizer's per-parameter state (AdamW's moments) to
    `device`, in place. Scalar state stays where the optimizer keeps it (AdamW's step counts on the host)."""
    trainer.model.to(device)
    for state in trainer.optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device)
