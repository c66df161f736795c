"""The models Meshy trains: one architecture record (meshy.dataplane.decoder_arch) per name.

How a record is built from torchtitan's components is meshy.train.titan_models.
"""

from meshy.dataplane import SchemaError
from meshy.dataplane.decoder_arch import LLAMA, QWEN3, QWEN3_MOE, DecoderArch


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
