"""The models Meshy trains: one architecture record per name, in Hugging Face config.json terms.

A record is plain data (recipes are validated by processes that never import torchtitan); how one is built
from torchtitan's components is meshy.train.titan_models.
"""

import math
from dataclasses import dataclass

from meshy.dataplane import SchemaError
from meshy.dataplane.fields import check_fields

QWEN3 = "Qwen3ForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
LLAMA = "LlamaForCausalLM"
_MODEL_TYPES = {QWEN3: "qwen3", QWEN3_MOE: "qwen3_moe", LLAMA: "llama"}
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
    bos_token_id: int
    eos_token_id: int
    rms_norm_eps: float = 1e-6
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    def __post_init__(self) -> None:
        """A recipe's model.overrides land here: refuse what would fail (or silently misbehave) when built."""
        check_fields(self)
        if self.architecture not in _MODEL_TYPES:
            raise SchemaError(
                f"DecoderArch.architecture: expected one of {list(_MODEL_TYPES)}, got {self.architecture!r}"
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
        for name in ("bos_token_id", "eos_token_id", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if getattr(self, name) < 0:
                raise SchemaError(f"DecoderArch.{name}: expected >= 0, got {getattr(self, name)}")
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

    def hf_config(self, torch_dtype: str = "bfloat16") -> dict:
        """config.json for the published HF directory."""
        config = {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPES[self.architecture],
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
            "eos_token_id": self.eos_token_id,
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
                norm_topk_prob=True,
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


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tied: bool, **moe: int):
    return DecoderArch(
        QWEN3_MOE if moe else QWEN3,
        hidden,
        intermediate,
        layers,
        heads,
        kv_heads,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1e6,
        max_position_embeddings=40960,
        tie_word_embeddings=tied,
        bos_token_id=151643,
        eos_token_id=151645,
        **moe,
    )


def _minicpm5(hidden: int, intermediate: int, layers: int) -> DecoderArch:
    return DecoderArch(
        LLAMA,
        hidden,
        intermediate,
        layers,
        16,
        2,
        head_dim=128,
        vocab_size=130560,
        rope_theta=5e6,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def _tiny(architecture: str, tied: bool, **moe: int) -> DecoderArch:
    """Small enough for CPU tests; every code path of its full-size family."""
    kv_heads, head_dim = (1, 32) if architecture == LLAMA else (2, 16)
    return DecoderArch(
        architecture,
        64,
        128,
        2,
        4,
        kv_heads,
        head_dim,
        vocab_size=512,
        rope_theta=1e6,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        **moe,
    )


MODELS: dict[str, DecoderArch] = {
    "qwen3-tiny": _tiny(QWEN3, tied=True),
    "qwen3-tiny-moe": _tiny(QWEN3_MOE, tied=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "minicpm5-tiny": _tiny(LLAMA, tied=False),
    # Production sizes, from each public checkpoint's config.json.
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, tied=False),
    "qwen3-30b-a3b": _qwen3(
        2048, 6144, 48, 32, 4, tied=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768
    ),
    "minicpm5-1b": _minicpm5(1536, 4608, 24),
    "minicpm5-2b": _minicpm5(2048, 6144, 42),
    # SmolLM2-135M(-Instruct): Llama, the MiniCPM5 code path at a size real weights fit on CPU tests.
    "smollm2-135m": DecoderArch(
        LLAMA,
        576,
        1536,
        30,
        9,
        3,
        head_dim=64,
        vocab_size=49152,
        rope_theta=1e5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
    ),
}
ALIASES = {"minicpm5-2.6b": "minicpm5-2b"}  # public configs name the 2B model "2.6B"


def get_model(name: str) -> DecoderArch:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise SchemaError(f"model: unknown name {name!r}; expected one of {sorted(MODELS) + sorted(ALIASES)}")
    return MODELS[key]
