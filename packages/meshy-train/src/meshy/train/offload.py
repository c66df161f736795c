"""Moving a trainer between devices: what a colocated trainer does when it hands its GPU over (to host
memory) and takes it back. Parameters, gradients and optimizer state all move; handing over also gives
the freed device memory back, before the token goes on."""

import torch

from meshy.dataplane import HOST, free_cached
from meshy.train.checkpoint import Trainer


def move(trainer: Trainer, device: torch.device) -> None:
    """Parameters and buffers, gradients and the optimizer's per-parameter state (AdamW's moments) to
    `device`, in place. Scalar state stays where the optimizer keeps it (AdamW's step counts on the host)."""
    trainer.model.to(device)
    for state in trainer.optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device)


def hand_over(trainer: Trainer, device: torch.device) -> None:
    """Give `device` up: the trainer's tensors to host memory, the memory they held back to the driver."""
    move(trainer, HOST)
    free_cached(device)
