"""GGUF file -> Hugging Face model directory: float32 weights under HF Llama names (model.safetensors),
config.json from the meshy.train architecture (checked against the GGUF metadata, number by number), and
tokenizer.json + tokenizer_config.json rebuilt from the GGUF's BPE vocabulary and chat template.

llama.cpp's converter permutes each head's q_proj/k_proj rows from HF's rotate-half RoPE layout to its
interleaved one; `_unpermute` undoes that. Only what the registered GGUFs need is supported (llama
architecture, gpt2-style BPE with the "smollm" pre-tokenizer); anything else is a SchemaError.
"""

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from meshy.dataplane import SchemaError
from meshy.train.models import LLAMA, DecoderArch

FORMAT = 1  # bump when what `convert_gguf` writes changes: converted caches are keyed by it

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp pre-tokenizer names -> the HF pipeline that splits text the same way.
_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
}


def convert_gguf(path: Path, arch: DecoderArch, out: Path) -> None:
    """Write the HF directory of the GGUF file `path`, which must hold a model of shape `arch`, into `out`."""
    reader = gguf.GGUFReader(path)
    _check_metadata(reader, arch, path)
    tensors = {}
    for tensor in reader.tensors:
        weight = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)  # [out, in], as in HF
        if tensor.name.endswith("attn_q.weight"):
            weight = _unpermute(weight, arch.num_attention_heads)
        elif tensor.name.endswith("attn_k.weight"):
            weight = _unpermute(weight, arch.num_key_value_heads)
        tensors[_hf_name(tensor.name, path)] = torch.from_numpy(np.ascontiguousarray(weight))
    if ("lm_head.weight" not in tensors) != arch.tie_word_embeddings:
        raise SchemaError(f"{path}: tie_word_embeddings is {arch.tie_word_embeddings} but output.weight is not")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(arch.hf_config(torch_dtype="float32"), indent=2))
    (out / "tokenizer.json").write_text(_tokenizer(reader, path).to_str())
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(reader, arch), indent=2))


def _value(reader: gguf.GGUFReader, key: str, path: Path):
    if key not in reader.fields:
        raise SchemaError(f"{path}: GGUF metadata has no {key!r}")
    return reader.fields[key].contents()


def _check_metadata(reader: gguf.GGUFReader, arch: DecoderArch, path: Path) -> None:
    kind = _value(reader, "general.architecture", path)
    if kind != "llama" or arch.architecture != LLAMA:
        raise SchemaError(f"{path}: expected a llama GGUF for a {LLAMA} model, got {kind!r} for {arch.architecture}")
    expected = {
        "llama.block_count": arch.num_hidden_layers,
        "llama.context_length": arch.max_position_embeddings,
        "llama.embedding_length": arch.hidden_size,
        "llama.feed_forward_length": arch.intermediate_size,
        "llama.attention.head_count": arch.num_attention_heads,
        "llama.attention.head_count_kv": arch.num_key_value_heads,
        "llama.rope.dimension_count": arch.head_dim,
        "llama.rope.freq_base": arch.rope_theta,
        "llama.attention.layer_norm_rms_epsilon": arch.rms_norm_eps,
        "llama.vocab_size": arch.vocab_size,
        "tokenizer.ggml.bos_token_id": arch.bos_token_id,
        "tokenizer.ggml.eos_token_id": arch.eos_token_id,
    }
    for key, want in expected.items():
        got = _value(reader, key, path)
        if not math.isclose(got, want, rel_tol=1e-6):  # the GGUF stores floats as float32
            raise SchemaError(f"{path}: GGUF {key} is {got}, the architecture expects {want}")


def _hf_name(name: str, path: Path) -> str:
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise SchemaError(f"{path}: GGUF tensor {name!r} has no Hugging Face Llama name")


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permute: rows (head, pair, half) of each head back to (head, half, pair)."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tokenizer(reader: gguf.GGUFReader, path: Path) -> Tokenizer:
    """Byte-level BPE with the GGUF's tokens (ids in order), merges (ranks in order) and control tokens."""
    if (kind := _value(reader, "tokenizer.ggml.model", path)) != "gpt2":
        raise SchemaError(f"{path}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) is supported")
    pre = _value(reader, "tokenizer.ggml.pre", path)
    if pre not in _PRE_TOKENIZERS:
        raise SchemaError(f"{path}: tokenizer.ggml.pre is {pre!r}; expected one of {sorted(_PRE_TOKENIZERS)}")
    tokens = _value(reader, "tokenizer.ggml.tokens", path)
    types = _value(reader, "tokenizer.ggml.token_type", path)
    unknown = {t for t in types if t not in (gguf.TokenType.NORMAL, gguf.TokenType.CONTROL)}
    if unknown:
        raise SchemaError(f"{path}: token types {sorted(unknown)} are not supported; expected NORMAL or CONTROL")
    merges = [tuple(merge.split(" ")) for merge in _value(reader, "tokenizer.ggml.merges", path)]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [token for token, kind in zip(tokens, types, strict=True) if kind == gguf.TokenType.CONTROL]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
    return tokenizer


def _tokenizer_config(reader: gguf.GGUFReader, arch: DecoderArch) -> dict:
    """What transformers' AutoTokenizer needs beyond tokenizer.json: special tokens and the chat template."""
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[arch.bos_token_id],
        "eos_token": tokens[arch.eos_token_id],
        "model_max_length": arch.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    for key, name in (("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        if f"tokenizer.ggml.{name}" in reader.fields:
            config[key] = tokens[reader.fields[f"tokenizer.ggml.{name}"].contents()]
    if "tokenizer.chat_template" in reader.fields:
        config["chat_template"] = reader.fields["tokenizer.chat_template"].contents()
    return config
