"""LoRA versions on the `weights` stream: what their announcement says of the adapters, and how their tensors
are named, so that the trainer that publishes them and every engine that applies them agree.

A LoRA run trains low-rank adapters on a frozen base. Its versions are announced with an `Adapter` (rank,
alpha, target modules, and the checksum of the base they apply onto); their tensors are the adapters under
PEFT's names (`base_model.model.<HF module>.lora_A.weight` and `.lora_B.weight`, as
`peft.get_peft_model_state_dict` names them), and the base's HF-named tensors only when the version carries the
base too (its first version, or one an engine asked for whole). An engine that holds the base named by
`Adapter.base` loads the adapters only; one that does not must get a version with the base.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from meshy.dataplane.errors import SchemaError

PEFT_PREFIX = "base_model.model."
LORA_A = ".lora_A.weight"
LORA_B = ".lora_B.weight"


@dataclass(frozen=True)
class Adapter:
    """The adapters of a LoRA version, as its announcement carries them. Each adapted module's weight W
    computes as W + scale * B A, with A [rank, in] and B [out, rank].

    target_modules: the adapted modules' last HF names (q_proj, ...), as PEFT's adapter_config.json lists them.
    base: the checksum (meshy.dataplane.weights.tensors_checksum) of the HF-named base tensors the adapters
        apply onto."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base: str

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise SchemaError(f"adapter rank: expected an int >= 1, got {self.rank!r}")
        if not 0 < self.alpha < math.inf:
            raise SchemaError(f"adapter alpha: expected a finite value > 0, got {self.alpha!r}")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise SchemaError(f"adapter target_modules: expected module names, got {self.target_modules!r}")
        if not isinstance(self.base, str) or not self.base:
            raise SchemaError(f"adapter base: expected the base weights' checksum, got {self.base!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules), "base": self.base}

    @classmethod
    def from_dict(cls, fields: Mapping) -> "Adapter":
        try:
            return cls(fields["rank"], fields["alpha"], tuple(fields["target_modules"]), fields["base"])
        except (KeyError, TypeError) as e:
            raise SchemaError(
                f"weights message adapter: expected rank, alpha, target_modules and base, got {fields!r}"
            ) from e

    def peft_config(self, base_model_name_or_path: str) -> dict:
        """The adapter_config.json PEFT writes for these adapters (peft.PeftModel.from_pretrained reads it)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name_or_path,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": sorted(self.target_modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
            "inference_mode": True,
        }


def is_adapter_tensor(name: str) -> bool:
    return name.startswith(PEFT_PREFIX) and name.endswith((LORA_A, LORA_B))


def adapter_names(weight: str) -> tuple[str, str]:
    """PEFT's (lora_A, lora_B) tensor names for the adapters of the HF weight `weight` (e.g.
    model.layers.0.self_attn.q_proj.weight)."""
    module = PEFT_PREFIX + weight.removesuffix(".weight")
    return module + LORA_A, module + LORA_B


def split_version(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """A LoRA version's (base tensors by HF name, possibly none; {adapted HF weight name: (A, B)}). Every
    adapter needs both halves, of matching rank."""
    base, halves = {}, {}
    for name, tensor in tensors.items():
        if is_adapter_tensor(name):
            halves[name] = tensor
        else:
            base[name] = tensor
    pairs = {}
    for name in halves:
        if not name.endswith(LORA_A):
            continue
        weight = name[len(PEFT_PREFIX) : -len(LORA_A)] + ".weight"
        a_name, b_name = adapter_names(weight)
        if b_name not in halves:
            raise SchemaError(f"weights tensor {a_name!r}: its {b_name!r} is missing")
        a, b = halves[a_name], halves[b_name]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise SchemaError(
                f"weights tensors {a_name!r} {tuple(a.shape)} and {b_name!r} {tuple(b.shape)}: expected A [r, in] "
                "and B [out, r]"
            )
        pairs[weight] = (a, b)
    unpaired = sorted(
        n for n in halves if n.endswith(LORA_B) and n[len(PEFT_PREFIX) : -len(LORA_B)] + ".weight" not in pairs
    )
    if unpaired:
        raise SchemaError(f"weights tensor {unpaired[0]!r}: its lora_A half is missing")
    return base, pairs
