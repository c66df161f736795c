"""Where an engine or the trainer gets a model's config and weights from (ModelSource), and reading it.
In the data plane, beside the `weights` stream's Published, so that meshy.infer and meshy.train (which
depend on the data plane and never on each other) take the same sources."""

import os
from collections.abc import Mapping

import torch

from meshy.dataplane.errors import SchemaError
from meshy.dataplane.hf_directory import HFDirectory
from meshy.dataplane.weights import Published, read_published

# A published version (verified), an HF model directory (config.json and *.safetensors, sharded or
# not), or a config.json dict with HF-named tensors.
ModelSource = Published | str | os.PathLike | tuple[Mapping, Mapping[str, torch.Tensor]]


def read_model(source: ModelSource) -> tuple[dict, Mapping[str, torch.Tensor]]:
    """(config.json as a dict, HF name -> tensor) of a model source."""
    if isinstance(source, Published):
        return read_published(source)
    if isinstance(source, tuple):
        if len(source) != 2 or not isinstance(source[0], Mapping) or not isinstance(source[1], Mapping):
            raise SchemaError("model source: expected a (config.json dict, HF name -> tensor mapping) pair")
        config, tensors = source
        return dict(config), tensors
    if isinstance(source, str | os.PathLike):
        return HFDirectory.open(source).read()
    raise SchemaError(
        f"model source: expected a Published version, an HF model directory or a (config, tensors) pair, "
        f"got {type(source).__name__}"
    )
