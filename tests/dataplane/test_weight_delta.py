"""Deltas between weights versions: what is sent, and that the receiver rebuilds the version bit for bit."""

import pytest
import torch

from meshy.dataplane import SchemaError, weight_delta
from meshy.dataplane.weights import CorruptWeights


def versions() -> tuple[dict, dict]:
    g = torch.Generator(device="cpu").manual_seed(0)
    base = {
        "still": torch.randn(64, 64, generator=g, device="cpu").to(torch.bfloat16),
        "few": torch.randn(64, 64, generator=g, device="cpu").to(torch.bfloat16),
        "many": torch.randn(64, 64, generator=g, device="cpu"),
    }
    current = {name: t.clone() for name, t in base.items()}
    current["few"].view(-1)[torch.tensor([3, 700, 4095], device="cpu")] += 1
    current["many"] += 1e-3
    return base, current


def test_unchanged_tensors_are_not_sent_few_changes_go_sparse_and_the_rest_whole():
    base, current = versions()
    places = {name: t.data_ptr() for name, t in base.items()}
    segments, delta = weight_delta.encode(current.items(), base)
    sent = dict(segments)
    assert delta["same"] == ["still"] and delta["sparse"] == ["few"]
    assert sorted(sent) == ["few:indices", "few:values", "many"]
    assert sent["few:indices"].tolist() == [3, 700, 4095] and sent["few:indices"].dtype == torch.int32
    assert torch.equal(sent["few:values"], current["few"].view(-1)[[3, 700, 4095]])
    assert torch.equal(sent["many"], current["many"]) and sent["many"] is base["many"], "sent from the base"
    for name, tensor in current.items():  # the sender's base is now this version, in the same memory
        assert torch.equal(base[name], tensor) and base[name].data_ptr() == places[name], name


def test_the_receiver_rebuilds_the_version_bit_for_bit_in_its_base():
    base, current = versions()
    segments, delta = weight_delta.encode(current.items(), {name: t.clone() for name, t in base.items()})
    held = dict(base)
    rebuilt = weight_delta.apply(1, dict(segments), held, delta)
    assert list(rebuilt) == list(current)
    for name, tensor in current.items():
        assert rebuilt[name].dtype == tensor.dtype
        assert torch.equal(rebuilt[name].view(torch.uint8), tensor.view(torch.uint8)), name
        assert rebuilt[name] is base[name], "rebuilt in place: no second copy of the model"


def test_changes_are_bitwise_a_sign_of_zero_counts_and_an_unchanged_nan_does_not():
    base = {"w": torch.zeros(100, device="cpu")}
    base["w"][5] = float("nan")
    current = {"w": base["w"].clone()}
    current["w"][0] = -0.0  # equal to 0.0 as a number, not as bits
    segments, delta = weight_delta.encode(current.items(), {"w": base["w"].clone()})
    assert delta["sparse"] == ["w"] and dict(segments)["w:indices"].tolist() == [0]
    rebuilt = weight_delta.apply(1, dict(segments), base, delta)
    assert torch.equal(rebuilt["w"].view(torch.int32), current["w"].view(torch.int32))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda t: t.update(grown=torch.zeros(9, device="cpu")), "'grown'.*float32\\[8\\] -> float32\\[9\\]"),
        (lambda t: t.update(new=torch.zeros(2, device="cpu")), "'new'.*absent -> float32\\[2\\]"),
        (lambda t: t.pop("grown"), "'grown'.*float32\\[8\\] -> absent"),
    ],
)
def test_a_delta_between_different_tensors_is_refused_naming_the_tensor(change, expected):
    base, current = versions()
    base["grown"] = current["grown"] = torch.zeros(8, device="cpu")
    change(current)
    with pytest.raises(SchemaError, match=expected):
        weight_delta.encode(current.items(), base)


def test_a_delta_on_tensors_the_receiver_does_not_hold_is_refused_and_changes_nothing():
    base, current = versions()
    held = {"still": base["still"].clone()}
    segments, delta = weight_delta.encode(current.items(), base)
    with pytest.raises(CorruptWeights, match="v5: a delta on other tensors than this engine holds \\(missing \\['few'"):
        weight_delta.apply(5, dict(segments), held, delta)
    assert torch.equal(held["still"], base["still"])
