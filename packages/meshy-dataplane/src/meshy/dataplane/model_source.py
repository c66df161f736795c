"""Where an engine or the trainer gets a model's config and weights from (ModelSource), and reading it.
In the data plane, beside the `weights` stream's Published, so that meshy.infer and meshy.train (which
depend on the data plane and never on each other) take the same sources."""

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from meshy.dataplane.adapters import Adapter
from meshy.dataplane.errors import SchemaError
from meshy.dataplane.hf_directory import AdapterDirectory, HFDirectory
from meshy.dataplane.weights import Published, read_published, tensors_checksum

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


def read_adapter_directory(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], Adapter]:
    """A PEFT LoRA adapter directory on the base its adapter_config.json names (a local HF directory, as a
    LoRA run's final_weights/ names its own): (the base's config.json, the base's tensors and the adapters',
    the Adapter an engine applies them with)."""
    adapters = AdapterDirectory.open(directory)
    config = adapters.config()
    try:
        base = Path(config["base_model_name_or_path"])
        rank, alpha, targets = config["r"], float(config["lora_alpha"]), tuple(config["target_modules"])
    except (KeyError, TypeError, ValueError) as e:
        raise SchemaError(
            f"adapter source {directory}: adapter_config.json: expected base_model_name_or_path, r, lora_alpha and "
            f"target_modules ({e!r})"
        ) from None
    if not base.is_dir():
        raise SchemaError(
            f"adapter source {directory}: adapter_config.json's base_model_name_or_path {str(base)!r} is not a "
            "directory here; expected the local HF directory of the base model"
        )
    base_config, tensors = HFDirectory.open(base).read()
    adapter = Adapter(rank, alpha, targets, tensors_checksum(tensors))
    return base_config, {**tensors, **dict(adapters.tensors())}, adapter
