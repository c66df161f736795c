"""Shape checks shared by the loss and advantage functions."""

from torch import Tensor


def check_same_2d_shape(**tensors: Tensor) -> None:
    """Raise ValueError unless every tensor is [B, T] with one shape, naming them all."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(shape != first for shape in shapes.values()):
        got = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"{', '.join(shapes)}: expected [B, T] tensors of one shape, got {got}")
