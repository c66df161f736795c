"""A weights version as what changed since the one before it, and rebuilt bit for bit from it.

Tensors are compared bitwise in the published dtype (after an RL step at a small learning rate, most
bf16 values do not move). A tensor that did not change is not sent; one whose changed elements are few
goes as their flat indices (int32) and new values; any other goes whole. The receiver rebuilds every
tensor from its copy of the base version, and the rebuilt version is checked against the announced
checksum like any other, so a receiver whose base is not the one the delta was made on cannot load a
wrong version: it refuses it and waits for the next full one.
"""

import torch

from meshy.dataplane.weights import CorruptWeights

INDICES, VALUES = ":indices", ":values"  # suffixes of a sparse tensor's two segments
SPARSE_AT_MOST = 0.5  # a tensor goes sparse when its indices and values take at most this share of it
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def encode(
    tensors: dict[str, torch.Tensor], base: dict[str, torch.Tensor]
) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """(segments to send, the delta's description) for `tensors` against `base` (the previous version)."""
    segments, same, sparse = [], [], []
    for name, tensor in tensors.items():
        old = base.get(name)
        if old is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
            segments.append((name, tensor))
            continue
        bits = _BITS[tensor.element_size()]
        changed = (tensor.reshape(-1).view(bits) != old.reshape(-1).view(bits)).nonzero().squeeze(1)
        if changed.numel() == 0:
            same.append(name)
        elif changed.numel() * (4 + tensor.element_size()) <= SPARSE_AT_MOST * tensor.numel() * tensor.element_size():
            sparse.append(name)
            segments += [(name + INDICES, changed.to(torch.int32)), (name + VALUES, tensor.reshape(-1)[changed])]
        else:
            segments.append((name, tensor))
    return segments, {"names": list(tensors), "same": same, "sparse": sparse}


def apply(
    version: int, segments: dict[str, torch.Tensor], base: dict[str, torch.Tensor], delta: dict
) -> dict[str, torch.Tensor]:
    """The full version rebuilt from its segments and `base` (CorruptWeights if base lacks a tensor)."""
    missing = [n for n in (*delta["same"], *delta["sparse"]) if n not in base]
    if missing:
        raise CorruptWeights(f"weights v{version}: a delta on tensors this engine does not hold: {missing[:3]}")
    same, sparse = set(delta["same"]), set(delta["sparse"])
    tensors = {}
    for name in delta["names"]:
        if name in same:
            tensors[name] = base[name]
        elif name in sparse:
            rebuilt = base[name].clone()
            rebuilt.view(-1)[segments[name + INDICES].long()] = segments[name + VALUES]
            tensors[name] = rebuilt
        else:
            tensors[name] = segments[name]
    return tensors
