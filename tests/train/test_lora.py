"""LoRA on the trainer's model: only the adapters train, PEFT loads what we save with our logits, and the
merged weights are the adapted model."""

import warnings

import pytest
import torch

from meshy.dataplane import SchemaError
from meshy.train.logprobs import forward_logits
from meshy.train.lora import LoraLinear, apply_lora, merged_state, peft_state_dict, save_adapter
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.publish import DirectoryPublisher
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LoraConfig, LossConfig, OptimConfig, ParallelConfig

EVERY_PROJECTION = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def tokens_and_mask(vocab_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab_size, (3, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(3, 11)
    mask[:, 4:] = 1
    return tokens, mask


def train(model: torch.nn.Module, vocab_size: int, steps: int, lr: float = 1e-2) -> PolicyTrainer:
    trainer = PolicyTrainer(model, OptimConfig(lr=lr), LossConfig(tis="none"))
    for step in range(steps):
        tokens, mask = tokens_and_mask(vocab_size, seed=step)
        metrics = trainer.step(PolicyBatch(tokens, mask, torch.tensor([1.0, -1.0, 0.5])))
        assert metrics["stepped"] == 1.0
    return trainer


def test_only_the_adapters_get_gradients_and_move_and_the_base_stays_bit_identical():
    arch = get_model("qwen3-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=1)
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    adapted = apply_lora(model, LoraConfig(rank=4, targets=EVERY_PROJECTION))
    assert len(adapted) == arch.num_hidden_layers * len(EVERY_PROJECTION)
    adapters = {name: p for name, p in model.named_parameters() if ".lora_" in name}
    assert {name for name, p in model.named_parameters() if p.requires_grad} == set(adapters)
    graded: set[str] = set()
    for name, p in adapters.items():
        p.register_post_accumulate_grad_hook(lambda _, name=name: graded.add(name))
    before = {name: p.detach().clone() for name, p in adapters.items()}

    trainer = train(model, arch.vocab_size, steps=2)

    assert {id(p) for group in trainer.optimizer.param_groups for p in group["params"]} == set(
        map(id, adapters.values())
    )
    assert graded == set(adapters)
    for name, p in model.named_parameters():
        if name in adapters:
            assert not torch.equal(p, before[name]), f"{name} did not move"
        else:
            assert p.grad is None
            assert torch.equal(p, base[name.replace(".base_layer.", ".")]), f"{name} moved"


@pytest.mark.parametrize("model_name", ["qwen3-tiny", "minicpm5-tiny"])
def test_new_adapters_leave_the_logits_exactly_as_they_were(model_name):
    arch = get_model(model_name)
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=2)
    tokens, _ = tokens_and_mask(arch.vocab_size)
    with torch.no_grad():
        before = forward_logits(model, tokens)
        apply_lora(model, LoraConfig(rank=4, alpha=32.0, targets=EVERY_PROJECTION))
        assert torch.equal(forward_logits(model, tokens), before)


@pytest.mark.parametrize("model_name", ["qwen3-tiny", "minicpm5-tiny"])
def test_peft_loads_the_saved_adapter_onto_the_hf_model_with_our_logits(model_name, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    arch = get_model(model_name)
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=3)
    base_dir = DirectoryPublisher(tmp_path / "base", arch, dtype="float32").publish(model, 0).location
    config = LoraConfig(rank=4, alpha=8.0, dropout=0.1, targets=EVERY_PROJECTION)
    apply_lora(model, config)
    train(model, arch.vocab_size, steps=3)
    directory = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=base_dir)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(hf, directory).eval()
    saved = load_file(directory / "adapter_model.safetensors")
    assert saved.keys() == get_peft_model_state_dict(peft_model).keys() == peft_state_dict(model).keys()
    assert peft_model.peft_config["default"].r == 4 and peft_model.peft_config["default"].lora_alpha == 8.0
    assert all(saved[name].abs().max() > 0 for name in saved if ".lora_B." in name), "trained adapters"
    model.eval()  # no dropout, as PEFT's eval mode
    tokens, _ = tokens_and_mask(arch.vocab_size, seed=9)
    with torch.no_grad():
        ours = forward_logits(model, tokens)
        theirs = peft_model(tokens[:, :-1]).logits.float()
        with peft_model.disable_adapter():
            base_logits = peft_model(tokens[:, :-1]).logits.float()
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (ours - base_logits).abs().max().item() > 1e-3, "the adapters change the logits"


def test_the_merged_weights_give_the_adapted_models_logits():
    arch = get_model("qwen3-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=4)
    plain, _ = build_model(arch, ParallelConfig(), device="cpu", seed=5)
    apply_lora(model, LoraConfig(rank=4, targets=("wq", "wv", "w2")))
    train(model, arch.vocab_size, steps=3)
    merged = merged_state(model)
    assert merged.keys() == plain.state_dict().keys()
    plain.load_state_dict(merged)
    tokens, _ = tokens_and_mask(arch.vocab_size, seed=7)
    with torch.no_grad():
        difference = (forward_logits(plain, tokens) - forward_logits(model, tokens)).abs().max().item()
    assert difference <= 1e-5
    wq = model.layers["0"].attention.qkv_linear.wq
    assert not torch.equal(merged["layers.0.attention.qkv_linear.wq.weight"], wq.base_layer.weight)


def test_no_adapter_tensor_is_created_without_naming_its_device():
    arch = get_model("qwen3-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=6)
    tokens, _ = tokens_and_mask(arch.vocab_size)
    torch.set_default_device("meta")
    try:
        apply_lora(model, LoraConfig(rank=4, targets=EVERY_PROJECTION))
    finally:
        torch.set_default_device(None)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not any(p.is_meta for p in model.parameters())
    layer = model.layers["1"].feed_forward.w2
    assert isinstance(layer, LoraLinear) and layer.lora_A.weight.abs().sum() > 0
    assert forward_logits(model, tokens).isfinite().all()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LoraConfig(rank=0), "LoraConfig.rank: expected >= 1, got 0"),
        (lambda: LoraConfig(rank=4.0), "LoraConfig.rank: expected int, got float 4.0"),
        (lambda: LoraConfig(alpha=0.0), "LoraConfig.alpha: expected a finite value > 0, got 0.0"),
        (lambda: LoraConfig(alpha=float("nan")), "LoraConfig.alpha: expected a finite value > 0, got nan"),
        (lambda: LoraConfig(dropout=1.0), "LoraConfig.dropout: expected a value in [0, 1), got 1.0"),
        (lambda: LoraConfig(dropout=-0.1), "LoraConfig.dropout: expected a value in [0, 1), got -0.1"),
        (lambda: LoraConfig(targets=()), "LoraConfig.targets: expected one or more distinct projection names"),
        (lambda: LoraConfig(targets=("wq", "wq")), "LoraConfig.targets: expected one or more distinct"),
        (lambda: LoraConfig(targets=["wq"]), "LoraConfig.targets: expected tuple[str, ...], got list"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(make, message):
    with pytest.raises(SchemaError) as error:
        make()
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("model_name", "targets", "message"),
    [
        ("qwen3-tiny", ("wq", "q_proj"), "unknown projection 'q_proj' for this model; expected names among "),
        ("qwen3-tiny-moe", ("w1",), "'w1' names a mixture-of-experts' expert weights"),
        ("qwen3-tiny-moe", ("wq", "w2_EDF"), "'w2_EDF' names a mixture-of-experts' expert weights"),
        ("qwen3-tiny-moe", ("gate",), "unknown projection 'gate'"),
    ],
)
def test_targets_the_model_cannot_adapt_are_refused_with_its_names(model_name, targets, message):
    model, _ = build_model(get_model(model_name), ParallelConfig(), device="cpu")
    with pytest.raises(SchemaError) as error:
        apply_lora(model, LoraConfig(targets=targets))
    text = str(error.value)
    assert text.startswith("LoraConfig.targets: ") and message in text
    valid = ["wk", "wo", "wq", "wv"] if "moe" in model_name else ["w1", "w2", "w3", "wk", "wo", "wq", "wv"]
    assert text.endswith(f"expected names among {valid}")
    assert all(p.requires_grad for p in model.parameters()), "a refused config leaves the model as it was"
    assert not any(isinstance(m, LoraLinear) for m in model.modules())


def test_a_mixtures_attention_can_be_adapted():
    arch = get_model("qwen3-tiny-moe")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=8)
    apply_lora(model, LoraConfig(rank=2, targets=("wq", "wo")))
    assert {name.split(".")[-3] for name in peft_state_dict(model)} == {"q_proj", "o_proj"}
    train(model, arch.vocab_size, steps=1)
