"""Deltas between weights versions: what is sent, and that the receiver rebuilds the version bit for bit."""

import pytest
import torch

from meshy.dataplane import weight_delta
from meshy.dataplane.weights import CorruptWeights


def versions() -> tuple[dict, dict]:
    g = torch.Generator(device="cpu").manual_seed(0)
    base = {
        "still": torch.randn(64, 64, generator=g, device="cpu").to(torch.bfloat16),
        "few": torch.randn(64, 64, generator=g, device="cpu").to(torch.bfloat16),
        "many": torch.randn(64, 64, generator=g, device="cpu"),
        "grown": torch.randn(8, generator=g, device="cpu"),
    }
    current = {name: t.clone() for name, t in base.items()}
    current["few"].view(-1)[torch.tensor([3, 700, 4095], device="cpu")] += 1
    current["many"] += 1e-3
    current["grown"] = torch.randn(9, generator=g, device="cpu")
    current["new"] = torch.zeros(2, 2, device="cpu")
    return base, current


def test_unchanged_tensors_are_not_sent_few_changes_go_sparse_and_the_rest_whole():
    base, current = versions()
    segments, delta = weight_delta.encode(current, base)
    sent = dict(segments)
    assert delta["same"] == ["still"] and delta["sparse"] == ["few"]
    assert sorted(sent) == ["few:indices", "few:values", "grown", "many", "new"]
    assert sent["few:indices"].tolist() == [3, 700, 4095] and sent["few:indices"].dtype == torch.int32
    assert torch.equal(sent["few:values"], current["few"].view(-1)[[3, 700, 4095]])


def test_the_receiver_rebuilds_the_version_bit_for_bit():
    base, current = versions()
    segments, delta = weight_delta.encode(current, base)
    rebuilt = weight_delta.apply(1, dict(segments), base, delta)
    assert list(rebuilt) == list(current)
    for name, tensor in current.items():
        assert rebuilt[name].dtype == tensor.dtype
        assert torch.equal(rebuilt[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert torch.equal(base["few"], versions()[0]["few"]), "the base is not changed in place"


def test_changes_are_bitwise_a_sign_of_zero_counts_and_an_unchanged_nan_does_not():
    base = {"w": torch.zeros(100, device="cpu")}
    base["w"][5] = float("nan")
    current = {"w": base["w"].clone()}
    current["w"][0] = -0.0  # equal to 0.0 as a number, not as bits
    segments, delta = weight_delta.encode(current, base)
    assert delta["sparse"] == ["w"] and dict(segments)["w:indices"].tolist() == [0]
    rebuilt = weight_delta.apply(1, dict(segments), base, delta)
    assert torch.equal(rebuilt["w"].view(torch.int32), current["w"].view(torch.int32))


def test_a_delta_on_tensors_the_receiver_does_not_hold_is_refused():
    base, current = versions()
    segments, delta = weight_delta.encode(current, base)
    with pytest.raises(CorruptWeights, match="v5: a delta on tensors this engine does not hold: \\['still'"):
        weight_delta.apply(5, dict(segments), {}, delta)
