"""The catalogue's models, one shape record each, which the trainer builds and the engine reads back."""

import dataclasses

import pytest

from meshy.dataplane.decoder_arch import DecoderArch
from meshy.infer.torch_model import ModelConfig
from meshy.train import models
from meshy.train.models import MODELS, get_model
from meshy.train.titan_models import titan_config


def test_the_trainer_and_the_engine_share_one_shape_record():
    assert models.DecoderArch is ModelConfig is DecoderArch


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_models_published_config_json_reads_back_as_the_model(name):
    arch = get_model(name)
    assert ModelConfig.from_hf(arch.hf_config("bfloat16")) == arch


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_trainers_router_renormalises_the_top_k_as_the_config_json_says(norm_topk_prob):
    arch = dataclasses.replace(get_model("qwen3-tiny-moe"), norm_topk_prob=norm_topk_prob)
    assert {layer.moe.router.route_norm for layer in titan_config(arch).layers} == {norm_topk_prob}
    assert arch.hf_config()["norm_topk_prob"] is norm_topk_prob
