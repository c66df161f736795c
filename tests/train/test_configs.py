"""Component configs refuse, when built, what the model builder, the optimizer, the loss or the engine would
refuse later: a recipe's values reach them all, and a recipe is checked before any process starts."""

import dataclasses

import pytest

from meshy.dataplane import SchemaError
from meshy.infer.engine import SamplingParams
from meshy.train.models import get_model
from meshy.train.training_config import LossConfig, OptimConfig

NAN, INF = float("nan"), float("inf")
TINY, MOE = get_model("qwen3-tiny"), get_model("qwen3-tiny-moe")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: OptimConfig(lr=INF), "OptimConfig: lr and max_grad_norm must be > 0"),
        (lambda: OptimConfig(lr=NAN), "OptimConfig: lr and max_grad_norm must be > 0"),
        (lambda: OptimConfig(betas=(0.9, 1.0)), "OptimConfig.betas: expected two values in [0, 1), got (0.9, 1.0)"),
        (lambda: OptimConfig(betas=(NAN, 0.9)), "OptimConfig.betas: expected two values in [0, 1)"),
        (lambda: OptimConfig(betas=(0.9,)), "OptimConfig.betas: expected tuple[float, float], got tuple (0.9,)"),
        (lambda: OptimConfig(eps=-1e-8), "OptimConfig.eps: expected a finite value >= 0, got -1e-08"),
        (lambda: OptimConfig(weight_decay=INF), "OptimConfig.weight_decay: expected a finite value >= 0, got inf"),
        (lambda: LossConfig(kl_coef=-0.1), "LossConfig.kl_coef: expected a finite value >= 0, got -0.1"),
        (lambda: LossConfig(pg_coef=NAN), "LossConfig.pg_coef: expected a finite value >= 0, got nan"),
        (lambda: LossConfig(entropy_coef=INF), "LossConfig.entropy_coef: expected a finite value, got inf"),
        (lambda: LossConfig(temperature=INF), "LossConfig.temperature: expected a finite value > 0, got inf"),
        (lambda: LossConfig(clip_low=1.0), "LossConfig.clip_low, clip_high: expected 0 <= clip_low < 1"),
        (lambda: LossConfig(clip_high=NAN), "clip_high >= 0, got 0.2, nan"),
        (lambda: LossConfig(dual_clip=0.5), "LossConfig.dual_clip: expected 0 (off) or a finite value > 1, got 0.5"),
        (lambda: LossConfig(dual_clip=NAN), "LossConfig.dual_clip: expected 0 (off) or a finite value > 1, got nan"),
        (lambda: LossConfig(tis_low=0.0), "LossConfig.tis_low, tis_high: expected 0 < tis_low <= 1 <= tis_high"),
        (lambda: LossConfig(tis_high=0.9), "got 0.5, 0.9"),
        (lambda: LossConfig(entropy_metric_tokens=-1), "LossConfig.entropy_metric_tokens: expected >= 0, got -1"),
        (lambda: dataclasses.replace(TINY, vocab_size="17"), "DecoderArch.vocab_size: expected int, got str '17'"),
        (lambda: dataclasses.replace(TINY, head_dim=0), "DecoderArch.head_dim: expected >= 1, got 0"),
        (lambda: dataclasses.replace(TINY, architecture="GPT2"), "DecoderArch.architecture: expected one of"),
        (lambda: dataclasses.replace(TINY, num_key_value_heads=3), "num_key_value_heads: 3 does not divide"),
        (lambda: dataclasses.replace(TINY, rms_norm_eps=NAN), "DecoderArch.rms_norm_eps: expected a finite value > 0"),
        (lambda: dataclasses.replace(TINY, eos_token_id=-1), "DecoderArch.eos_token_id: expected >= 0, got -1"),
        (lambda: dataclasses.replace(MOE, num_experts_per_tok=5), "a mixture needs 1 <= num_experts_per_tok <="),
        (lambda: SamplingParams(4, temperature=NAN), "SamplingParams.temperature: expected a finite value >= 0"),
        (lambda: SamplingParams(4, temperature=INF), "SamplingParams.temperature: expected a finite value >= 0"),
    ],
)
def test_bad_values_name_the_field(make, message):
    with pytest.raises(SchemaError) as excinfo:
        make()
    assert message in str(excinfo.value)


def test_the_edges_of_the_ranges_are_allowed():
    OptimConfig(betas=(0.0, 0.0), eps=0.0, weight_decay=0.0, max_grad_norm=INF)
    LossConfig(pg_coef=0.0, distill_coef=1.0, clip_low=0.0, clip_high=INF, tis_low=1.0, tis_high=1.0)
    LossConfig(entropy_coef=-0.01, entropy_metric_tokens=0)
    SamplingParams(4, temperature=0.0)
