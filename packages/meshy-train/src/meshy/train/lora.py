"""Low-rank adapters (LoRA) on the trainer's torchtitan model, saved in PEFT's format.

`apply_lora` replaces each targeted projection (an nn.Linear) by a LoraLinear that keeps it as `base_layer`
beside `lora_A` and `lora_B`, the names PEFT gives them, and freezes every base parameter, so an optimizer over
the parameters that require grad trains the adapters only. build_model adds them to the model on the meta
device, before it is parallelized, so FSDP2 shards the adapters with their blocks, and initialises them
(`init_adapters`) once the model is materialised: the same values on one process and sharded.

Publishers read the model through three iterators that gather one tensor at a time, as
meshy.train.publish.full_hf_tensors does: `adapter_tensors` (the adapters under PEFT's names for the HF model of
the same architecture), `base_tensors` (the frozen base under the unadapted model's torchtitan names) and
`merged_tensors` (each adapter merged into its base weight: what an engine without LoRA loads). A publisher
writes them as a PEFT adapter directory (meshy.train.publish).
"""

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.module import Module

from meshy.dataplane import HOST, SchemaError
from meshy.dataplane.adapters import adapter_names
from meshy.train.training_config import LoraConfig

# Mixed into the model's seed for the adapters' generator, so their draws are not the base's first ones.
_ADAPTER_SEED = 0x4C6F5241  # "LoRA"


class LoraLinear(Module):
    """A frozen Linear plus scale * B A dropout(x), as PEFT's LoRA layer computes it.

    A torchtitan Module, so the model's `init_weights` initialises `base_layer` where it did before (in the
    same order, from the same generator: a model's base is the same with or without adapters) and passes the
    plain nn.Linear adapters by; `init_adapters` initialises those. The adapters are created uninitialised
    (meta, then emptied onto the base's device) so that creating them draws no random numbers."""

    def __init__(self, base: nn.Linear, config: LoraConfig):
        super().__init__()
        weight = base.weight
        self.base_layer = base
        self.lora_A = _empty_linear(base.in_features, config.rank, weight)
        self.lora_B = _empty_linear(config.rank, base.out_features, weight)
        self.dropout = nn.Dropout(config.dropout)
        self.config = config

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def alpha(self) -> float:
        return self.config.alpha

    @property
    def scale(self) -> float:
        return self.config.alpha / self.config.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scale


def _empty_linear(in_features: int, out_features: int, like: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(in_features, out_features, bias=False, device="meta", dtype=like.dtype)
    return linear.to_empty(device=like.device)


def apply_lora(model: nn.Module, config: LoraConfig, *, seed: int = 0) -> list[str]:
    """Freeze `model` and adapt its `config.targets` projections in every layer; the adapted modules' names.
    The adapters are initialised from `seed` (init_adapters), unless the model is on the meta device.

    A target is a torchtitan projection name (wq, wk, wv, wo, and a dense MLP's w1, w2, w3); one the model
    lacks is refused with the names it has, and a mixture's experts (grouped weights, not Linear modules)
    are refused as such. A sharded model is refused: build_model(..., lora=) adds adapters before sharding."""
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
        raise SchemaError(
            "apply_lora: the model is sharded; build_model(..., lora=) adds the adapters before it shards the model"
        )
    model.requires_grad_(False)
    adapted = []
    for target in config.targets:
        for name in projections[target]:
            parent, _, attribute = name.rpartition(".")
            owner = model.get_submodule(parent)
            setattr(owner, attribute, LoraLinear(getattr(owner, attribute), config))
            adapted.append(name)
    if not next(model.parameters()).is_meta:
        init_adapters(model, seed)
    return adapted


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Each A as nn.Linear's (PEFT's) Kaiming-uniform init (a = sqrt(5)), B zero, so new adapters leave the
    model's outputs unchanged. The A are drawn in model order from one generator seeded from `seed`, whole
    on every rank, each rank keeping its shard: the same values on one process and under FSDP."""
    generator = torch.Generator(HOST).manual_seed(seed ^ _ADAPTER_SEED)
    for module in _lora_modules(model):
        a = module.lora_A.weight
        full = torch.empty(a.shape, dtype=torch.float32, device=HOST)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
        full = full.to(device=a.device, dtype=a.dtype)
        a.copy_(distribute_tensor(full, a.device_mesh, a.placements, src_data_rank=None) if _sharded(a) else full)
        module.lora_B.weight.zero_()


def lora_config_of(model: nn.Module) -> LoraConfig | None:
    """The LoraConfig the model's adapters were built with; None for a model without adapters."""
    modules = _lora_modules(model)
    return modules[0].config if modules else None


def _lora_modules(model: nn.Module) -> list[LoraLinear]:
    return [module for module in model.modules() if isinstance(module, LoraLinear)]


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
    """The adapted modules, in model order, by their base weight's name as the unadapted model's state dict
    has it."""
    names = {id(value): name for name, value in model.state_dict(keep_vars=True).items()}
    return {names[id(module.base_layer.weight)].replace(".base_layer.", "."): module for module in _lora_modules(model)}


def _sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, detached: a DTensor is gathered (a collective every rank joins)."""
    return (tensor.full_tensor() if _sharded(tensor) else tensor).detach()


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def adapter_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, full tensor) of each adapter, in model order, A before B: the names
    `peft.get_peft_model_state_dict` gives them on the HF model of the same architecture
    (base_model.model.<HF module>.lora_A.weight, .lora_B.weight). Gathered one at a time: every rank must
    iterate; only rank 0 gets data."""
    # The adapter titan_models.state_dict_adapter builds, from the config the model was built from.
    to_hf = Qwen3StateDictAdapter(model.config, None).to_hf
    for name, module in _adapted(model).items():
        (hf_name,) = to_hf({name: module.base_layer.weight})
        for peft_name, linear in zip(adapter_names(hf_name), (module.lora_A, module.lora_B), strict=True):
            full = _full(linear.weight)
            if _is_writer():
                yield peft_name, full


def base_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(torchtitan name, full tensor) of everything in the model's state dict but the adapters, under the
    names the unadapted model has (no `.base_layer.`): the whole model, for a model without adapters.
    Every rank must iterate; only rank 0 gets data."""
    for name, full in _all_base_tensors(model):
        if _is_writer():
            yield name, full


def merged_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """base_tensors with each adapter merged into its base weight, W + scale * B A (computed in float32, in
    W's dtype): the unadapted model's state dict, what an engine without LoRA loads. Tensors that no adapter
    touches are the model's own (not copies), on one process. Every rank must iterate; only rank 0 gets data."""
    adapted = _adapted(model)
    for name, full in _all_base_tensors(model):
        module = adapted.get(name)
        if module is not None:
            a, b = _full(module.lora_A.weight), _full(module.lora_B.weight)
            if _is_writer():
                full = (full.float() + module.scale * (b.float() @ a.float())).to(full.dtype)
        if _is_writer():
            yield name, full


def _all_base_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """base_tensors on every rank."""
    state = model.state_dict(keep_vars=True)
    for unadapted, name in base_names(model).items():
        yield unadapted, _full(state[name])


def base_names(model: nn.Module) -> dict[str, str]:
    """The state-dict entries but the adapters, in order: {name in the unadapted model: name in `model`}."""
    adapters = {id(linear.weight) for module in _lora_modules(model) for linear in (module.lora_A, module.lora_B)}
    state = model.state_dict(keep_vars=True)
    return {name.replace(".base_layer.", "."): name for name, value in state.items() if id(value) not in adapters}
