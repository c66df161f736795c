"""The experts a mixture-of-experts model chose for each generated token, kept on the host.

Entry i holds, for every MoE layer, the top-k expert ids of the forward position that produced output
token i (its logits were sampled to give token i): the prompt's last position for token 0, the position
of token i - 1 after that. That is the routing the trainer replays for the same positions, and it is
aligned with the response like every other per-token column.
"""

import torch

from meshy.dataplane import HOST

EXPERT_ID_DTYPE = torch.int16  # up to 32,767 experts; 768 bytes per token for a 48-layer top-8 model


class RoutingLog:
    """Expert ids [tokens, layers, top_k] appended one token at a time, in a host buffer grown by doubling
    (a request keeps one compact tensor, however many steps it runs)."""

    def __init__(self, layers: int, top_k: int):
        self._buffer = torch.empty(16, layers, top_k, dtype=EXPERT_ID_DTYPE, device=HOST)
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def append(self, experts: torch.Tensor) -> None:
        """One token's expert ids [layers, top_k] (a host tensor)."""
        if self._length == len(self._buffer):
            grown = torch.empty(2 * len(self._buffer), *self._buffer.shape[1:], dtype=EXPERT_ID_DTYPE, device=HOST)
            grown[: self._length] = self._buffer
            self._buffer = grown
        self._buffer[self._length] = experts
        self._length += 1

    def tensor(self) -> torch.Tensor:
        """Every token's expert ids so far [tokens, layers, top_k] (a copy)."""
        return self._buffer[: self._length].clone()
