"""The model's shape, and its config.json both ways: what meshy.train publishes, meshy.infer reads back."""

import dataclasses
import subprocess
import sys

import pytest

from meshy.dataplane import SchemaError
from meshy.dataplane.decoder_arch import FORWARD_FIELDS, LLAMA, QWEN3, QWEN3_MOE, DecoderArch

DENSE = DecoderArch(
    QWEN3,
    64,
    128,
    2,
    4,
    2,
    16,
    vocab_size=512,
    rope_theta=1e6,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dataclasses.replace(DENSE, architecture=QWEN3_MOE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.parametrize("arch", [DENSE, MOE, dataclasses.replace(DENSE, architecture=LLAMA, rms_norm_eps=1e-5)])
def test_config_json_reads_back_as_the_shape_it_was_written_from(arch):
    assert DecoderArch.from_hf(arch.hf_config("float32")) == arch


@pytest.mark.parametrize(
    ("written", "eos_token_id", "eos_token_ids"), [(7, 7, (7,)), ([7, 9], (7, 9), (7, 9)), (None, None, ())]
)
def test_eos_is_an_id_several_or_none_as_config_json_has_it(written, eos_token_id, eos_token_ids):
    arch = DecoderArch.from_hf({**DENSE.hf_config(), "eos_token_id": written})
    assert (arch.eos_token_id, arch.eos_token_ids) == (eos_token_id, eos_token_ids)
    assert arch.hf_config()["eos_token_id"] == written


def test_fields_config_json_leaves_out_take_hugging_faces_defaults():
    config = DENSE.hf_config()
    for name in ("num_key_value_heads", "head_dim", "rope_theta", "tie_word_embeddings", "bos_token_id"):
        del config[name]
    arch = DecoderArch.from_hf({**config, "rope_scaling": {"rope_type": "default", "rope_theta": 5e5}})
    assert (arch.num_key_value_heads, arch.head_dim, arch.rope_theta) == (4, 16, 5e5)
    assert (arch.tie_word_embeddings, arch.bos_token_id) == (False, None)


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "config.json architectures: expected one of"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "config.json rope: only the default rope type is supported"),
        ({"head_dim": -1}, "config.json: DecoderArch.head_dim: expected >= 1, got -1"),
        ({"architectures": [QWEN3_MOE]}, "missing field 'num_experts' (needed by Qwen3MoeForCausalLM)"),
    ],
)
def test_a_config_json_that_describes_no_model_here_is_refused(changed, message):
    with pytest.raises(SchemaError) as e:
        DecoderArch.from_hf({**DENSE.hf_config(), **changed})
    assert message in str(e.value)


@pytest.mark.parametrize("name", ["hidden_size", "rms_norm_eps", "max_position_embeddings"])
def test_a_config_json_must_name_the_sizes(name):
    with pytest.raises(SchemaError, match=f"config.json: missing field '{name}' \\(needed by {QWEN3}\\)"):
        DecoderArch.from_hf({k: v for k, v in DENSE.hf_config().items() if k != name})


@pytest.mark.parametrize(
    "make",
    [
        lambda: dataclasses.replace(DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        lambda: dataclasses.replace(MOE, num_experts=0),
    ],
)
def test_experts_go_with_the_mixture_architecture(make):
    """The trainer builds a mixture from num_experts, the engine from the architecture: they must agree."""
    with pytest.raises(SchemaError, match=f"DecoderArch.num_experts: {QWEN3_MOE} has experts and the other"):
        make()


def test_a_checkpoint_may_differ_from_the_model_only_in_token_ids_and_context_length():
    assert "norm_topk_prob" in FORWARD_FIELDS and "architecture" in FORWARD_FIELDS
    other = dataclasses.replace(DENSE, bos_token_id=None, eos_token_id=(2, 3), max_position_embeddings=4096)
    assert [name for name in FORWARD_FIELDS if getattr(other, name) != getattr(DENSE, name)] == []


def test_the_shape_imports_without_torch():
    code = "import sys, meshy.dataplane.decoder_arch; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
