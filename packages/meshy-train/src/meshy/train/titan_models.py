"""How a DecoderArch is built from torchtitan's Qwen3 decoder components, and its state-dict adapter.

MiniCPM5 is plain Llama, which is that decoder with QK-norm off (untied embeddings, GQA, RoPE in the
rotate-half layout both HF classes use), so one state-dict adapter serves all: Llama's HF weight names are
Qwen3's without q_norm/k_norm. QKV projections stay separate (torchtitan's fused QKV does not load through
distributed state dicts). Attention is causal SDPA over right-padded batches, which runs on CPU and GPU alike.
"""

from dataclasses import dataclass
from functools import partial

import torch.nn as nn
import torch.nn.functional as F
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import (
    make_ffn_config,
    make_gqa_config,
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.model import Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from meshy.train.models import DecoderArch
from meshy.train.routing_replay import replay_router_config

_NORMAL = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}


class MaskedAttention(ScaledDotProductAttention):
    """torchtitan's causal SDPA, or, given a boolean mask [B, 1, L, L] as `attention_masks` (True: the query
    may attend to the key), SDPA under that mask: sequences whose rows share a prompt packed into one
    (meshy.train.shared_prompts)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        if attention_masks is None:
            return super().forward(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa, **kwargs)
        q, k, v = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


_ONES = {"weight": nn.init.ones_}


def titan_config(arch: DecoderArch) -> Qwen3Model.Config:
    """The torchtitan model config (build it under `torch.device("meta")` for large sizes)."""
    dim, head_dim = arch.hidden_size, arch.head_dim
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=arch.max_position_embeddings, theta=arch.rope_theta)
    layers = []
    for _ in range(arch.num_hidden_layers):
        attention = make_gqa_config(
            dim=dim,
            n_heads=arch.num_attention_heads,
            n_kv_heads=arch.num_key_value_heads,
            head_dim=head_dim,
            wqkv_param_init=_NORMAL,
            wo_param_init=_NORMAL,
            inner_attention=MaskedAttention.Config(),
            rope=rope,
            fuse_qkv=False,
            qk_norm=_norm(arch, head_dim) if arch.qk_norm else None,
        )
        block = Qwen3TransformerBlock.Config(
            attention_norm=_norm(arch, dim),
            ffn_norm=_norm(arch, dim),
            attention=attention,
            feed_forward=None if arch.moe else _ffn(arch),
            moe=_moe(arch) if arch.moe else None,
        )
        layers.append(block)
    return Qwen3Model.Config(
        vocab_size=arch.vocab_size,
        dim=dim,
        norm=_norm(arch, dim),
        enable_weight_tying=arch.tie_word_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=arch.vocab_size, embedding_dim=dim, param_init=_NORMAL),
        lm_head=Linear.Config(in_features=dim, out_features=arch.vocab_size, param_init=_NORMAL),
        layers=layers,
    )


def _norm(arch: DecoderArch, size: int) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=size, eps=arch.rms_norm_eps, param_init=_ONES)


def _ffn(arch: DecoderArch):
    return make_ffn_config(
        dim=arch.hidden_size, hidden_dim=arch.intermediate_size, w1_param_init=_NORMAL, w2w3_param_init=_NORMAL
    )


def _moe(arch: DecoderArch):
    experts_init = {name: _NORMAL["weight"] for name in ("w1_EFD", "w2_EDF", "w3_EFD")}
    return make_moe_config(
        num_experts=arch.num_experts,
        # No auxiliary-loss-free balancing bias: Qwen3's routing has none (an HF checkpoint could not fill
        # one), and the optimizer hook that would move it is torchtitan's trainer's, not ours.
        load_balance_coeff=None,
        router=replay_router_config(  # torchtitan's router, which can also replay given routing
            make_router_config(
                dim=arch.hidden_size,
                num_experts=arch.num_experts,
                gate_param_init=_NORMAL,
                top_k=arch.num_experts_per_tok,
                score_func="softmax",
                route_norm=arch.norm_topk_prob,
            )
        ),
        routed_experts=make_routed_experts_config(
            dim=arch.hidden_size,
            hidden_dim=arch.moe_intermediate_size,
            num_experts=arch.num_experts,
            top_k=arch.num_experts_per_tok,
            param_init=experts_init,
            comm_backend="standard",
        ),
    )


def state_dict_adapter(arch: DecoderArch) -> Qwen3StateDictAdapter:
    """Maps torchtitan parameter names to and from the exact HF names."""
    return Qwen3StateDictAdapter(titan_config(arch), None)
