"""A pure-torch decoder with the Hugging Face forward of LlamaForCausalLM, Qwen3ForCausalLM and
Qwen3MoeForCausalLM, and a slot-based KV cache for batched decoding.

Qwen3 is Llama with RMSNorm over head_dim on q and k before RoPE; Qwen3-MoE replaces every MLP by a
routed mixture of SwiGLU experts. RoPE is the default rotate-half kind (no scaling).

A decode step is bound by how many ops it launches, not by arithmetic (per-op dispatch on a CPU, kernel
launches on a GPU, even inside a CUDA graph), so each layer launches few: q, k and v are one projection,
and gate and up another (their weights stacked by rows, each HF tensor a view of its rows), and RoPE is
two multiplies and a roll. `hf_parameters` names every parameter, or rows of one, by its HF tensor name.
"""

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from meshy.dataplane import HOST, SchemaError
from meshy.dataplane.decoder_arch import DecoderArch
from meshy.dataplane.hf_directory import check_tensor_shapes

LM_HEAD = "lm_head.weight"
ModelConfig = DecoderArch  # the engine's name for the model's shape, which its callers import


class KVCache:
    """Keys and values of every slot, per layer [slots, kv_heads, max_len, head_dim]. Zero-filled:
    positions past a slot's length are masked out, but a masked weight of 0 times NaN would still be NaN."""

    def __init__(self, config: DecoderArch, slots: int, max_len: int, device: torch.device, dtype: torch.dtype):
        shape = self.shape(config, slots, max_len)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]

    @staticmethod
    def shape(config: DecoderArch, slots: int, max_len: int) -> tuple[int, int, int, int]:
        """One layer's keys (or values)."""
        return (slots, config.num_key_value_heads, max_len, config.head_dim)

    def copy_slots(self, sources: Sequence[int], targets: Sequence[int], width: int) -> None:
        """The first `width` positions of each source slot's keys and values into its target slot."""
        device = self.keys[0].device
        source = torch.tensor(list(sources), device=HOST).to(device, non_blocking=True)
        target = torch.tensor(list(targets), device=HOST).to(device, non_blocking=True)
        for cache in (*self.keys, *self.values):
            cache[target, :, :width] = cache[source, :, :width]

    @classmethod
    def nbytes(cls, config: DecoderArch, slots: int, max_len: int, dtype: torch.dtype) -> int:
        """What the cache of `slots` requests of `max_len` tokens takes, keys and values of every layer."""
        return 2 * config.num_hidden_layers * math.prod(cls.shape(config, slots, max_len)) * dtype.itemsize


class _Causal:
    """Whole sequences, no cache: each position attends to itself and the positions before it."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class _Prefill(_Causal):
    """Sequences from position 0, right-padded to the longest, each stored in its slot. Causal attention
    keeps every real token from seeing the padding after it; the padding's keys and values land past a
    slot's length, where decoding overwrites each position before any query can attend to it."""

    def __init__(self, cache: KVCache, slots: torch.Tensor):
        self.cache, self.slots = cache, slots

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        width = k.shape[2]
        self.cache.keys[layer][self.slots, :, :width] = k
        self.cache.values[layer][self.slots, :, :width] = v
        return super().attend(layer, q, k, v)


class _Decode:
    """One new token for each of the slots 0..B-1 at its position [B]; each attends to its slot's cache up
    to itself, over the first `span` positions. Shapes depend only on (B, span), so a step can be
    replayed as a CUDA graph; rows of idle slots compute at position 0 and are ignored by the caller
    (a slot is always prefilled from position 0 before it is decoded for real). With one query per
    row, the query heads that share a key/value head are its queries: grouped attention reads each
    key and value once, without expanding them per head."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, span: int):
        self.cache, self.positions, self.span = cache, positions, span
        self.rows = torch.arange(len(positions), device=positions.device)
        visible = torch.arange(span, device=positions.device)[None, :] <= positions[:, None]
        self.mask = visible[:, None, None, :]  # [batch, kv heads, queries, keys]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        keys[self.rows, :, self.positions] = k[:, :, 0]
        values[self.rows, :, self.positions] = v[:, :, 0]
        batch, heads, _, head_dim = q.shape
        kv_heads = keys.shape[1]
        grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
        k_span, v_span = keys[:batch, :, : self.span], values[:batch, :, : self.span]
        out = F.scaled_dot_product_attention(grouped, k_span, v_span, attn_mask=self.mask)
        return out.reshape(batch, heads, 1, head_dim)


_Step = _Causal | _Prefill | _Decode


def _rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [batch, seq, 1, head_dim] in float32 (rotate-half layout: frequencies repeated;
    the sin of the first half negated, so that rotate_half(x) * sin == roll(x, half) * signed sin)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions[..., None].float() * inv_freq
    sin = angles.sin()
    return torch.cat([angles, angles], dim=-1).cos()[:, :, None, :], torch.cat([-sin, sin], dim=-1)[:, :, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE in float32: x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1]."""
    x32 = x.float()
    return torch.addcmul(x32 * cos, x32.roll(x.shape[-1] // 2, dims=-1), signed_sin).type_as(x)


class Projection(nn.Linear):
    """A bias-free Linear whose weight a LoRA version's adapters may be merged into: `base_weight` then
    keeps the weight they apply onto (`DecoderModel.set_adapters`)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.register_buffer("base_weight", None, persistent=False)


class Attention(nn.Module):
    def __init__(self, config: DecoderArch, layer: int):
        super().__init__()
        self.layer = layer
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        d, h = config.hidden_size, config.head_dim
        self.qkv_proj = Projection(d, (self.heads + 2 * self.kv_heads) * h)  # q, k, v rows stacked
        self.o_proj = Projection(self.heads * h, d)
        self.q_norm = nn.RMSNorm(h, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(h, eps=config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], step: _Step) -> torch.Tensor:
        batch, length, _ = x.shape
        qkv = self.qkv_proj(x).view(batch, length, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        # Query and key heads rotate together: one RoPE's few kernels instead of two (same numbers).
        qk = (
            qkv[:, :, : self.heads + self.kv_heads]
            if self.q_norm is None
            else torch.cat([self.q_norm(q), self.k_norm(k)], 2)
        )
        q, k = _rotate(qk, *rope).split([self.heads, self.kv_heads], dim=2)
        out = step.attend(self.layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = Projection(hidden_size, 2 * intermediate_size)  # gate, up rows stacked
        self.down_proj = Projection(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MixtureOfExperts(nn.Module):
    """Router softmax in float32, top-k experts (renormalised when norm_topk_prob), weighted sum of
    their outputs, as HF's Qwen3MoeSparseMoeBlock. Also returns the experts each token chose, in order
    of falling router probability, for routing replay."""

    def __init__(self, config: DecoderArch):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixture's output (shaped as x) and the chosen experts [*x.shape[:-1], top_k] (int64)."""
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(tokens)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(tokens)
        for expert in chosen.unique().tolist():
            rows, rank = torch.where(chosen == expert)
            out.index_add_(0, rows, self.experts[expert](tokens[rows]) * weights[rows, rank, None])
        return out.view(x.shape), chosen.view(*x.shape[:-1], self.top_k)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 routing weights and expert ids [tokens, top_k] of hidden states [tokens, hidden]."""
        probs = F.softmax(self.gate(tokens), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderArch, layer: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MixtureOfExperts(config) if config.moe else MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], step: _Step
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output and, in a mixture, the experts each position chose [batch, seq, top_k]."""
        x = x + self.self_attn(self.input_layernorm(x), rope, step)
        if isinstance(self.mlp, MixtureOfExperts):
            out, chosen = self.mlp(self.post_attention_layernorm(x))
            return x + out, chosen
        return x + self.mlp(self.post_attention_layernorm(x)), None


class DecoderBody(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, config: DecoderArch):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DecoderModel(nn.Module):
    """The causal LM. Build it with `load_model`; its state-dict keys are the HF tensor names."""

    def __init__(self, config: DecoderArch):
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def hidden(
        self, tokens: torch.Tensor, positions: torch.Tensor, step: _Step
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-norm hidden states [batch, seq, hidden] of tokens at positions [batch, seq], and for a
        mixture the experts every layer chose [batch, seq, top_k] (one tensor per layer; none if dense)."""
        rope = _rope(positions, self.config.head_dim, self.config.rope_theta)
        x = self.model.embed_tokens(tokens)
        routed = []
        for layer in self.model.layers:
            x, chosen = layer(x, rope, step)
            if chosen is not None:
                routed.append(chosen)
        return self.model.norm(x), routed

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, head).float()

    def score_logits(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Float32 logits [batch, seq - 1 - start, vocab] predicting tokens[:, start + 1:]."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.logits(self.hidden(tokens, positions, _Causal())[0][:, start:-1])

    def prefill(
        self, sequences: Sequence[torch.Tensor], cache: KVCache, slots: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store each sequence [seq_i] in its slot of the cache, in one forward; the float32 logits
        [batch, vocab] after each one's last token, and for a mixture the experts each layer chose there
        [batch, layers, top_k] (None if dense): the routing that produced those logits."""
        device = sequences[0].device
        tokens = nn.utils.rnn.pad_sequence(list(sequences), batch_first=True)
        positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        hidden, routed = self.hidden(tokens, positions, _Prefill(cache, torch.tensor(list(slots), device=device)))
        rows = torch.arange(len(sequences), device=device)
        last = torch.tensor([len(s) - 1 for s in sequences], device=device)
        return self.logits(hidden[rows, last]), _stack_layers([chosen[rows, last] for chosen in routed])

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, span: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token [B] for each of the slots 0..B-1 at its position [B] (every slot in use must hold its
        first `position` tokens already), attending over the first `span` cache positions: the final-norm
        hidden states [B, hidden] (`logits` turns the rows wanted into logits), and for a mixture the
        experts each layer chose [B, layers, top_k] (None if dense)."""
        hidden, routed = self.hidden(tokens[:, None], positions[:, None], _Decode(cache, positions, span))
        return hidden[:, 0], _stack_layers([chosen[:, 0] for chosen in routed])

    def _parts(self, module: str, rows: int) -> list[tuple[str, int, int]]:
        """The HF projections whose weights a stacked module's weight holds by rows: (name, first row, rows);
        the module itself when it stacks none."""
        if module == "qkv_proj":
            heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
            names = ("q_proj", "k_proj", "v_proj")
            sizes = [n * self.config.head_dim for n in (heads, kv_heads, kv_heads)]
        elif module == "gate_up_proj":
            names, sizes = ("gate_proj", "up_proj"), [rows // 2, rows // 2]
        else:
            return [(module, 0, rows)]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return list(zip(names, starts, sizes, strict=True))

    def hf_parameters(self) -> dict[str, torch.Tensor]:
        """Every weight by its HF tensor name: a parameter, or the rows of a stacked one (views: writing
        to them writes the model)."""
        named = {}
        for name, param in self.state_dict().items():
            prefix, _, leaf = name.rpartition(".")
            stem, _, module = prefix.rpartition(".")
            parts = self._parts(module, param.shape[0]) if param.ndim == 2 else []
            if len(parts) < 2:
                named[name] = param
                continue
            named.update({f"{stem}.{part}.{leaf}": param[start : start + rows] for part, start, rows in parts})
        return named

    def projections(self) -> dict[str, tuple[Projection, int, int]]:
        """Every weight adapters can apply to, by its HF tensor name: its Projection and its rows there."""
        found = {}
        for name, module in self.named_modules():
            if isinstance(module, Projection):
                stem, _, leaf = name.rpartition(".")
                for part, start, rows in self._parts(leaf, module.out_features):
                    found[f"{stem}.{part}.weight"] = (module, start, rows)
        return found

    def check_adapters(self, adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """SchemaError unless every adapter ({HF weight name: (A [r, in], B [out, r])}) fits a projection."""
        projections = self.projections()
        for name, (a, b) in sorted(adapters.items()):
            if name not in projections:
                raise SchemaError(
                    f"adapters for {name}: no such projection in {self.config.architecture}; expected a layer's "
                    f"attention or MLP projection, e.g. {next(iter(projections))}"
                )
            module, _, rows = projections[name]
            if a.shape[1] != module.in_features or b.shape[0] != rows:
                raise SchemaError(
                    f"adapters for {name}: A {tuple(a.shape)} and B {tuple(b.shape)}, expected A [r, "
                    f"{module.in_features}] and B [{rows}, r]"
                )

    def set_adapters(self, adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """Merge `adapters` ({HF weight name: (A, B)}, checked first) into the base weights they apply onto,
        W = base + scale * B A (computed in float32, from the base kept aside, never by subtracting the
        previous adapters: rounding would drift), in place of the ones the model had; none drops them.
        The weights change in place, so the decode graphs keep reading them.

        Merged rather than applied beside the weights (W x + scale * B (A x) in every forward): measured on
        CPU, one thread, ranks 8 and 32, qwen3-tiny and a SmolLM2-135M shape in float32 and bfloat16, both
        match the trainer alike (float32: within 2e-6 in logprob), and the unmerged forward cost 10 to 47%
        more per decode step (batch 8) while merging cost 0.08 to 0.7 s more per version on the 135M model
        than setting adapters aside: paid back within about 20 decode steps, and a version spans hundreds."""
        self.check_adapters(adapters)
        by_module: dict[Projection, list[tuple[int, int, tuple | None]]] = {}
        for name, (module, start, rows) in self.projections().items():
            by_module.setdefault(module, []).append((start, rows, adapters.get(name)))
        for module, parts in by_module.items():
            if all(pair is None for _, _, pair in parts):
                if module.base_weight is not None:
                    module.weight.copy_(module.base_weight)
                    module.base_weight = None
                continue
            if module.base_weight is None:
                module.base_weight = module.weight.clone()
            for start, rows, pair in parts:
                base, weight = module.base_weight[start : start + rows], module.weight[start : start + rows]
                if pair is None:
                    weight.copy_(base)
                    continue
                a, b = (half.to(weight.device, torch.float32) for half in pair)
                weight.copy_(torch.addmm(base.float(), b, a, alpha=scale))

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in (converted to the model's dtype and device). Every name and shape is
        checked first, so a set that does not fit changes nothing."""
        params = self.hf_parameters()
        shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
        if self.lm_head is None:
            shapes.pop(LM_HEAD, None)  # some tied checkpoints store it anyway; HF ignores it too
        expected = {name: tuple(param.shape) for name, param in params.items()}
        check_tensor_shapes(f"weights for {self.config.architecture}", shapes, expected)
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(tensors[name])
            for module in self.modules():
                if isinstance(module, Projection):
                    module.base_weight = None  # the new weights are the base


def _stack_layers(routed: list[torch.Tensor]) -> torch.Tensor | None:
    """Per-layer expert ids [rows, top_k] as one tensor [rows, layers, top_k]; None for a dense model."""
    return torch.stack(routed, dim=1) if routed else None


def load_model(
    config: DecoderArch, tensors: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> DecoderModel:
    """The model in inference mode on `device` in `dtype`, holding `tensors` (never randomly initialised)."""
    with torch.device("meta"):
        model = DecoderModel(config)
    model = model.to(dtype=dtype).to_empty(device=device).requires_grad_(False).eval()
    model.load_weights(tensors)
    return model
