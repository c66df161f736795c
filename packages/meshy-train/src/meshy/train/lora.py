"""Low-rank adapters (LoRA) on the trainer's torchtitan model, saved in PEFT's format.

`apply_lora` replaces each targeted projection (an nn.Linear) by a LoraLinear that keeps it as `base_layer`
beside `lora_A` and `lora_B`, the names PEFT gives them, and freezes every base parameter, so an optimizer over
the parameters that require grad trains the adapters only. An adapter version is `peft_state_dict` (PEFT's
names for the HF model of the same architecture, mapped by torchtitan's own state-dict adapter) written by
`save_adapter`; an engine without LoRA loads `merged_state` instead.

Adapters are added to a single-process model, after build_model: a sharded model's adapters would need
sharding too, and are refused.
"""

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from meshy.dataplane import HOST, SchemaError
from meshy.train.training_config import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraLinear(nn.Module):
    """A frozen Linear plus scale * B A dropout(x), as PEFT's LoRA layer computes it. A starts as nn.Linear's
    (PEFT's) Kaiming-uniform init and B at zero, so a new adapter leaves the model's outputs unchanged."""

    def __init__(self, base: nn.Linear, config: LoraConfig):
        super().__init__()
        weight = base.weight
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, config.rank, bias=False, device=weight.device, dtype=weight.dtype)
        self.lora_B = nn.Linear(config.rank, base.out_features, bias=False, device=weight.device, dtype=weight.dtype)
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(config.dropout)
        self.scale = config.alpha / config.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scale

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + scale * B A, computed in float32, in W's dtype."""
        weight = self.base_layer.weight
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
        return (weight.float() + self.scale * delta).to(weight.dtype)


def apply_lora(model: nn.Module, config: LoraConfig) -> list[str]:
    """Freeze `model` and adapt its `config.targets` projections in every layer; the adapted modules' names.

    A target is a torchtitan projection name (wq, wk, wv, wo, and a dense MLP's w1, w2, w3); one the model
    lacks is refused with the names it has, and a mixture's experts (grouped weights, not Linear modules)
    are refused as such."""
    if any(isinstance(module, LoraLinear) for module in model.modules()):
        raise SchemaError("apply_lora: the model already has adapters")
    projections = _projections(model)
    experts = _expert_names(model)
    for target in config.targets:
        if target in experts:
            raise SchemaError(
                f"LoraConfig.targets: {target!r} names a mixture-of-experts' expert weights, which are grouped "
                f"tensors, not Linear modules; expected names among {sorted(projections)}"
            )
        if target not in projections:
            raise SchemaError(
                f"LoraConfig.targets: unknown projection {target!r} for this model; expected names among "
                f"{sorted(projections)}"
            )
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise SchemaError("apply_lora: the model is sharded; adapters are added to a single-process model only")
    model.requires_grad_(False)
    adapted = []
    for target in config.targets:
        for name in projections[target]:
            parent, _, attribute = name.rpartition(".")
            owner = model.get_submodule(parent)
            setattr(owner, attribute, LoraLinear(getattr(owner, attribute), config))
            adapted.append(name)
    return adapted


def _projections(model: nn.Module) -> dict[str, list[str]]:
    """Each adaptable projection name: the modules of that name, the decoder layers' Linear modules outside a
    mixture (whose router gate is no projection)."""
    found: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("layers.") and ".moe." not in name:
            found.setdefault(name.rpartition(".")[2], []).append(name)
    return found


def _expert_names(model: nn.Module) -> set[str]:
    """The expert weights' names (w1_EFD) and the dense projections they stand for (w1)."""
    names = set()
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name, _ in module.named_parameters(recurse=False):
                names |= {name, name.partition("_")[0]}
    return names


def _adapted(model: nn.Module) -> dict[str, LoraLinear]:
    """The adapted modules by their base weight's name as the unadapted model's state dict has it."""
    names = {id(value): name for name, value in model.state_dict(keep_vars=True).items()}
    return {
        names[id(module.base_layer.weight)].replace(".base_layer.", "."): module
        for module in model.modules()
        if isinstance(module, LoraLinear)
    }


def peft_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under the names `peft.get_peft_model_state_dict` gives them on the HF model of the same
    architecture (base_model.model.<HF module>.lora_A.weight, .lora_B.weight)."""
    # The adapter titan_models.state_dict_adapter builds, from the config the model was built from.
    to_hf = Qwen3StateDictAdapter(model.config, None).to_hf
    state = {}
    for name, module in _adapted(model).items():
        (hf_name,) = to_hf({name: module.base_layer.weight})
        prefix = "base_model.model." + hf_name.removesuffix(".weight")
        state[f"{prefix}.lora_A.weight"] = module.lora_A.weight.detach()
        state[f"{prefix}.lora_B.weight"] = module.lora_B.weight.detach()
    return state


def save_adapter(model: nn.Module, config: LoraConfig, directory: str | Path, base_model_name_or_path: str) -> Path:
    """Write the adapters as PEFT does (adapter_config.json, adapter_model.safetensors) into `directory`, which
    `peft.PeftModel.from_pretrained` loads onto the base model; the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.to(HOST).contiguous() for name, tensor in peft_state_dict(model).items()}
    save_file(state, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    modules = sorted({name.split(".")[-3] for name in state})  # PEFT matches target_modules by the last name
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return directory


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unadapted model's state dict with each adapter merged into its base weight (W + scale * B A): what
    an engine without LoRA loads. Tensors that no adapter touches are the model's own (not copies)."""
    adapted = _adapted(model)
    adapters = {id(p) for module in adapted.values() for p in (module.lora_A.weight, module.lora_B.weight)}
    state = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in adapters:
            continue
        name = name.replace(".base_layer.", ".")
        state[name] = adapted[name].merged_weight() if name in adapted else value.detach()
    return state
