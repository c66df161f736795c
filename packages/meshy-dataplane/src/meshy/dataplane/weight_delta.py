"""A weights version as what changed since the one before it, and rebuilt bit for bit from it.

Tensors are compared bitwise in the published dtype (after an RL step at a small learning rate, most
bf16 values do not move). A tensor that did not change is not sent; one whose changed elements are few
goes as their flat indices (int32) and new values; any other goes whole. A delta is made between two
versions of the same tensors (names, dtypes, shapes), so the sender advances its copy of the base to the
new version in place as it encodes, and the receiver rebuilds the version in place in its copy: neither
holds a second copy of the model. The rebuilt version is checked against the announced
checksum like any other, so a receiver whose base is not the one the delta was made on cannot load a
wrong version: it refuses it and waits for the next full one.
"""

from collections.abc import Iterable

import torch

from meshy.dataplane.errors import SchemaError
from meshy.dataplane.weights import CorruptWeights

INDICES, VALUES = ":indices", ":values"  # suffixes of a sparse tensor's two segments
SPARSE_AT_MOST = 0.5  # a tensor goes sparse when its indices and values take at most this share of it
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def encode(
    tensors: Iterable[tuple[str, torch.Tensor]], base: dict[str, torch.Tensor]
) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """(segments to send, the delta's description) for the next version, `tensors` (name, tensor in the
    published dtype), against `base`, the previous version of the same tensors. `base` becomes the next
    version in place as each tensor is compared, so a sender holds one copy of the model, as a receiver
    does; a tensor sent whole is sent as its place in `base`. SchemaError if the tensors are not those of
    `base` (names, dtypes, shapes): `base` is then partly advanced, no longer any version."""
    segments, same, sparse, names = [], [], [], []
    for name, tensor in tensors:
        old = base.get(name)
        _check_same_tensor(name, old, tensor)
        names.append(name)
        bits = _BITS[tensor.element_size()]
        changed = (tensor.reshape(-1).view(bits) != old.reshape(-1).view(bits)).nonzero().squeeze(1)
        if changed.numel() == 0:
            same.append(name)
            continue
        if changed.numel() * (4 + tensor.element_size()) <= SPARSE_AT_MOST * tensor.numel() * tensor.element_size():
            sparse.append(name)
            segments += [(name + INDICES, changed.to(torch.int32)), (name + VALUES, tensor.reshape(-1)[changed])]
        else:
            segments.append((name, old))
        old.copy_(tensor)
    for name in sorted(base.keys() - set(names)):
        _check_same_tensor(name, base[name], None)
    return segments, {"names": names, "same": same, "sparse": sparse}


def apply(
    version: int, segments: dict[str, torch.Tensor], base: dict[str, torch.Tensor], delta: dict
) -> dict[str, torch.Tensor]:
    """`base` turned into the version in place, from its segments; returns `base` (CorruptWeights if base
    does not hold the delta's tensors, and then base is unchanged)."""
    if sorted(delta["names"]) != sorted(base):
        missing = sorted(set(delta["names"]) - set(base))
        raise CorruptWeights(
            f"weights v{version}: a delta on other tensors than this engine holds "
            f"(missing {missing[:3]}, {len(base)} held)"
        )
    same, sparse = set(delta["same"]), set(delta["sparse"])
    for name in delta["names"]:
        if name in sparse:
            base[name].view(-1)[segments[name + INDICES].long()] = segments[name + VALUES]
        elif name not in same:
            base[name].copy_(segments[name])
    return base


def _check_same_tensor(name: str, old: torch.Tensor | None, new: torch.Tensor | None) -> None:
    if new is None or old is None or new.shape != old.shape or new.dtype != old.dtype:
        raise SchemaError(
            f"weights delta: tensor {name!r} is not the same tensor in both versions "
            f"({_spec(old)} -> {_spec(new)}): a delta needs the same names, dtypes and shapes"
        )


def _spec(tensor: torch.Tensor | None) -> str:
    return "absent" if tensor is None else f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
