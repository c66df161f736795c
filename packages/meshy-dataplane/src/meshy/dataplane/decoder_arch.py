"""A decoder LLM's shape, in Hugging Face config.json terms, and its config.json (to and from): the one
record meshy.train builds and publishes, meshy.infer serves and meshy.recipes checks checkpoints against.

Plain data (recipes are validated by processes that never import torch); the catalogue of named models is
meshy.train.models.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from meshy.dataplane.errors import SchemaError
from meshy.dataplane.fields import check_fields

QWEN3 = "Qwen3ForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
LLAMA = "LlamaForCausalLM"
MODEL_TYPES = {QWEN3: "qwen3", QWEN3_MOE: "qwen3_moe", LLAMA: "llama"}
_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class DecoderArch:
    """A decoder LLM's shape; field names follow Hugging Face config.json."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | tuple[int, ...] | None  # as config.json has it: an id, several, or none
    rms_norm_eps: float = 1e-6
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        """A recipe's model.overrides land here: refuse what would fail (or silently misbehave) when built."""
        check_fields(self)
        if self.architecture not in MODEL_TYPES:
            raise SchemaError(
                f"DecoderArch.architecture: expected one of {list(MODEL_TYPES)}, got {self.architecture!r}"
            )
        for name in _SIZES:
            if getattr(self, name) < 1:
                raise SchemaError(f"DecoderArch.{name}: expected >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise SchemaError(
                f"DecoderArch.num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        for name in ("rope_theta", "rms_norm_eps"):
            if not 0 < getattr(self, name) < math.inf:
                raise SchemaError(f"DecoderArch.{name}: expected a finite value > 0, got {getattr(self, name)}")
        for name, ids in (("bos_token_id", _ids(self.bos_token_id)), ("eos_token_id", self.eos_token_ids)):
            if any(i < 0 for i in ids):
                raise SchemaError(f"DecoderArch.{name}: expected >= 0, got {getattr(self, name)}")
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if getattr(self, name) < 0:
                raise SchemaError(f"DecoderArch.{name}: expected >= 0, got {getattr(self, name)}")
        if self.moe != (self.architecture == QWEN3_MOE):
            raise SchemaError(
                f"DecoderArch.num_experts: {QWEN3_MOE} has experts and the other architectures none, "
                f"got {self.num_experts} for {self.architecture}"
            )
        if self.moe and not (1 <= self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size >= 1):
            raise SchemaError(
                "DecoderArch: a mixture needs 1 <= num_experts_per_tok <= num_experts and moe_intermediate_size >= 1, "
                f"got {self.num_experts_per_tok}, {self.num_experts}, {self.moe_intermediate_size}"
            )

    @property
    def qk_norm(self) -> bool:
        return self.architecture != LLAMA

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end a response."""
        return _ids(self.eos_token_id)

    @classmethod
    def from_hf(cls, config: Mapping) -> "DecoderArch":
        """The shape a config.json describes; the fields it may leave out take Hugging Face's defaults."""
        architectures = config.get("architectures") or []
        if len(architectures) != 1 or architectures[0] not in MODEL_TYPES:
            raise SchemaError(f"config.json architectures: expected one of {list(MODEL_TYPES)}, got {architectures}")
        architecture = architectures[0]

        def field(name: str):
            if name not in config:
                raise SchemaError(f"config.json: missing field {name!r} (needed by {architecture})")
            return config[name]

        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise SchemaError(f"config.json rope: only the default rope type is supported, got {rope}")
        eos = config.get("eos_token_id")
        moe = {}
        if architecture == QWEN3_MOE:
            if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
                raise SchemaError("config.json decoder_sparse_step/mlp_only_layers: every layer must be a mixture")
            moe = {
                "num_experts": field("num_experts"),
                "num_experts_per_tok": field("num_experts_per_tok"),
                "moe_intermediate_size": field("moe_intermediate_size"),
                "norm_topk_prob": config.get("norm_topk_prob", True),
            }
        shape = {
            "architecture": architecture,
            "hidden_size": field("hidden_size"),
            "intermediate_size": field("intermediate_size"),
            "num_hidden_layers": field("num_hidden_layers"),
            "num_attention_heads": field("num_attention_heads"),
            "num_key_value_heads": config.get("num_key_value_heads") or field("num_attention_heads"),
            "head_dim": config.get("head_dim") or field("hidden_size") // field("num_attention_heads"),
            "vocab_size": field("vocab_size"),
            "rope_theta": rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            "max_position_embeddings": field("max_position_embeddings"),
            "tie_word_embeddings": config.get("tie_word_embeddings", False),
            "bos_token_id": config.get("bos_token_id"),
            "eos_token_id": tuple(eos) if isinstance(eos, list) else eos,
            "rms_norm_eps": field("rms_norm_eps"),
            **moe,
        }
        try:
            return cls(**shape)
        except SchemaError as e:
            raise SchemaError(f"config.json: {e}") from None

    def hf_config(self, torch_dtype: str = "bfloat16") -> dict:
        """config.json for the published HF directory."""
        config = {
            "architectures": [self.architecture],
            "model_type": MODEL_TYPES[self.architecture],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "use_cache": True,
            "torch_dtype": torch_dtype,
        }
        if self.architecture == LLAMA:
            config["mlp_bias"] = False
            config["pretraining_tp"] = 1
        if self.moe:
            config.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                router_aux_loss_coef=0.001,
                output_router_logits=False,
            )
        return config

    def num_parameters(self) -> int:
        """Parameter count from the architecture alone (tied embeddings counted once)."""
        d, h = self.hidden_size, self.head_dim
        attention = d * h * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        attention += 2 * h if self.qk_norm else 0
        if self.moe:
            mlp = self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
        else:
            mlp = 3 * d * self.intermediate_size
        per_layer = attention + mlp + 2 * d
        embeddings = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + d + embeddings


# A checkpoint may set these differently from the model that loads its weights (a base checkpoint's
# eos_token_id is not its instruct model's): neither the weights nor the forward depend on them.
_NOT_IN_THE_WEIGHTS = ("bos_token_id", "eos_token_id", "max_position_embeddings")
FORWARD_FIELDS = tuple(f.name for f in fields(DecoderArch) if f.name not in _NOT_IN_THE_WEIGHTS)
"""The fields a checkpoint's config.json must agree on with the model its weights load into."""


def _ids(value: int | tuple[int, ...] | None) -> tuple[int, ...]:
    return () if value is None else value if isinstance(value, tuple) else (value,)
