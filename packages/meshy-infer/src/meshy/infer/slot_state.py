"""What each cache slot of TorchEngine decodes next, kept on the device, and advanced there by each step.

Per slot: the token it feeds next, that token's position, its request's seed and sampling settings,
the index of the token it draws (the counter of its uniforms), and whether a request holds it. A
decode step reads the state of slots 0..batch-1 and writes the next one itself: the sampled tokens
become the next inputs, and held slots move one position on (idle slots stay at position 0, where
their unread rows compute). So a decode step takes nothing from the host: on CUDA the whole step
(forward, logits, sampling, advance) is one replayed graph, and the host's only contact with the
device is reading the sampled tokens back. The host writes a slot's state only when the slot changes
hands (a request admitted and prefilled, a cache recomputed after onload, a request finished), in one
copy before the next step.
"""

import torch

from meshy.dataplane import HOST
from meshy.infer import sampling

TOKEN, POSITION, SEED, COUNTER, HELD = range(5)  # rows of SlotState.ints
TEMPERATURE, TOP_K, TOP_P = range(3)  # rows of SlotState.settings
Slots = slice | torch.Tensor  # slots 0..batch-1 of a decode step, or the slots a prefill fills (int64)


class SlotState:
    """The decode state of `slots` cache slots on `device`; `vocab` is what top_k 0 (off) becomes."""

    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.vocab = vocab
        self.ints = torch.zeros(5, slots, dtype=torch.int64, device=device)
        self.settings = torch.zeros(3, slots, dtype=torch.float32, device=device)
        self._pending: dict[int, tuple[list[int], list[float]]] = {}  # slot -> (ints, settings) to write

    def hold(
        self, slot: int, token: int, position: int, seed: int, counter: int, settings: tuple[float, int, float]
    ) -> None:
        """From the next step, `slot` feeds `token` at `position` and draws its token number `counter`
        with `seed` and settings (temperature, top_k, top_p). A prefill is such a step for each prompt:
        its last token at its last position, drawing token 0."""
        temperature, top_k, top_p = settings
        self._pending[slot] = ([token, position, seed, counter, 1], [temperature, top_k or self.vocab, top_p])

    def free(self, slot: int) -> None:
        """From the next step, `slot` is idle (it computes at position 0, unread)."""
        self._pending[slot] = ([0, 0, 0, 0, 0], [1.0, self.vocab, 1.0])

    def flush(self) -> None:
        """Write the slots changed since the last step, in one copy to the device (none if none changed).
        Settings travel as their float32 bits beside the integers."""
        if not self._pending:
            return
        slots = list(self._pending)
        ints = torch.tensor([self._pending[s][0] for s in slots], dtype=torch.int64, device=HOST)
        floats = torch.tensor([self._pending[s][1] for s in slots], dtype=torch.float32, device=HOST)
        index = torch.tensor(slots, dtype=torch.int64, device=HOST)[:, None]
        packed = torch.cat([index, ints, floats.view(torch.int32).to(torch.int64)], dim=1)
        self._pending.clear()
        on_device = packed.to(self.ints.device, non_blocking=True)
        index = on_device[:, 0]
        self.ints.index_copy_(1, index, on_device[:, 1:6].T)
        self.settings.index_copy_(1, index, on_device[:, 6:].to(torch.int32).view(torch.float32).T)

    def inputs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and positions [batch] of slots 0..batch-1: a decode step's inputs."""
        return self.ints[TOKEN, :batch], self.ints[POSITION, :batch]

    def rows(self, slots: Slots, truncated: bool) -> sampling.Rows:
        """The sampling rows of `slots` (`truncated`: some held slot among them has top_k or top_p on)."""
        ints, settings = take(self.ints, 1, slots), take(self.settings, 1, slots)
        return sampling.Rows(
            temperature=settings[TEMPERATURE],
            top_k=settings[TOP_K].long(),
            top_p=settings[TOP_P],
            seed=ints[SEED],
            counter=ints[COUNTER],
            truncated=truncated,
        )

    def advance(self, slots: Slots, chosen: torch.Tensor) -> None:
        """After `slots` drew `chosen`: each feeds its token next, and held slots move to the next
        position and token index. Slots given by index must all be held (a prefill's, or the running
        ones of an eager step)."""
        if isinstance(slots, slice):
            held = self.ints[HELD, slots]
            self.ints[TOKEN, slots] = chosen
            self.ints[POSITION, slots] += held
            self.ints[COUNTER, slots] += held
            return
        self.ints[TOKEN].index_copy_(0, slots, chosen)
        moving = self.ints[POSITION : COUNTER + 1 : COUNTER - POSITION]  # a view of both rows
        moving.index_add_(1, slots, torch.ones(2, len(slots), dtype=torch.int64, device=slots.device))


def take(tensor: torch.Tensor, dim: int, slots: Slots) -> torch.Tensor:
    """`tensor`'s entries of `slots` along `dim`: a view for a range, a gather (index_select, cheaper
    than advanced indexing) for an index."""
    if isinstance(slots, slice):
        return tensor[(slice(None),) * dim + (slots,)]
    return tensor.index_select(dim, slots)
