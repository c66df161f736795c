"""LoRA on the trainer's model: only the adapters train, PEFT loads what we save with our logits, and the
merged weights are the adapted model."""

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from meshy.dataplane import SchemaError
from meshy.recipes.weights.pretrained import load_init
from meshy.train import checkpoint
from meshy.train.logprobs import forward_logits
from meshy.train.lora import (
    LoraLinear,
    adapter_tensors,
    apply_lora,
    base_tensors,
    lora_config_of,
    merged_tensors,
)
from meshy.train.models import get_model
from meshy.train.parallel import build_model, load_weights
from meshy.train.publish import DirectoryPublisher
from meshy.train.titan_models import state_dict_adapter
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
def test_peft_loads_a_published_adapter_onto_the_hf_model_with_our_logits(model_name, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    arch = get_model(model_name)
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=3)
    base_dir = DirectoryPublisher(tmp_path / "base", arch, dtype="float32").publish(model, 0).location
    config = LoraConfig(rank=4, alpha=8.0, dropout=0.1, targets=EVERY_PROJECTION)
    apply_lora(model, config)
    train(model, arch.vocab_size, steps=3)
    directory = Path(DirectoryPublisher(tmp_path / "lora", arch, dtype="float32").publish(model, 1).location)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(hf, directory).eval()
    saved = load_file(directory / "adapter_model.safetensors")
    assert saved.keys() == get_peft_model_state_dict(peft_model).keys() == dict(adapter_tensors(model)).keys()
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
    merged = dict(merged_tensors(model))
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
    assert {name.split(".")[-3] for name in dict(adapter_tensors(model))} == {"q_proj", "o_proj"}
    train(model, arch.vocab_size, steps=1)


def hf_weights(model: torch.nn.Module, arch) -> dict[str, torch.Tensor]:
    """The model's base under HF names, as model.init gives them."""
    return state_dict_adapter(arch).to_hf(dict(base_tensors(model)))


@pytest.mark.parametrize("activation_checkpoint", ["none", "full"])
def test_build_model_adds_adapters_to_the_base_it_builds_without_them(activation_checkpoint):
    """The adapters are added before parallelize (here: activation checkpointing wraps the blocks that hold
    them); the base is what the same seed builds without adapters, the adapters what apply_lora gives it."""
    arch, config = get_model("qwen3-tiny"), LoraConfig(rank=4, targets=("wq", "wv", "w2"))
    parallel = ParallelConfig(activation_checkpoint=activation_checkpoint)
    model, _ = build_model(arch, parallel, device="cpu", seed=3, lora=config)
    plain, _ = build_model(arch, ParallelConfig(), device="cpu", seed=3)
    assert lora_config_of(model) == config and lora_config_of(plain) is None
    base = dict(base_tensors(model))
    assert base.keys() == plain.state_dict().keys()
    assert all(torch.equal(base[name], value) for name, value in plain.state_dict().items())
    merged = dict(merged_tensors(model))
    assert all(torch.equal(merged[name], value) for name, value in plain.state_dict().items()), "B starts at 0"

    apply_lora(plain, config, seed=3)
    assert dict(adapter_tensors(model)).keys() == dict(adapter_tensors(plain)).keys()
    assert all(torch.equal(a, dict(adapter_tensors(plain))[name]) for name, a in adapter_tensors(model))
    other, _ = build_model(arch, ParallelConfig(), device="cpu", seed=4, lora=config)
    a_name = next(name for name in dict(adapter_tensors(model)) if name.endswith(".lora_A.weight"))
    other_a, model_a = (dict(adapter_tensors(m))[a_name] for m in (other, model))
    assert not torch.equal(other_a, model_a), "A comes from the seed"
    wq = model.layers["0"].attention.qkv_linear.wq
    assert (wq.rank, wq.alpha, wq.scale) == (4, config.alpha, config.alpha / 4)

    trained = [dict(adapter_tensors(train(one, arch.vocab_size, steps=2).model)) for one in (model, plain)]
    for name, value in trained[0].items():
        assert torch.allclose(value, trained[1][name], rtol=1e-5, atol=1e-7), name
        assert ".lora_A." in name or value.abs().max() > 0, f"{name} did not train"


def test_only_the_adapters_hold_optimizer_state():
    arch = get_model("qwen3-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=1, lora=LoraConfig(rank=2))
    trainer = train(model, arch.vocab_size, steps=2)
    adapters = [p for name, p in model.named_parameters() if ".lora_" in name]
    assert len(adapters) == 2 * 4 * arch.num_hidden_layers
    assert set(map(id, trainer.optimizer.state)) == set(map(id, adapters))
    assert sum(len(state) for state in trainer.optimizer.state.values()) == 3 * len(adapters)  # step, exp_avg(_sq)


def test_hf_weights_load_into_the_base_of_an_adapted_model_and_leave_its_adapters(tmp_path):
    """load_weights and model.init's load_init: the base into base_layer, the adapters as they were; any
    other mismatch refused, under the unadapted model's names."""
    arch = get_model("qwen3-tiny")
    source, _ = build_model(arch, ParallelConfig(), device="cpu", seed=1)
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=2, lora=LoraConfig(rank=2))
    train(model, arch.vocab_size, steps=1)
    adapters = dict(adapter_tensors(model))
    weights = hf_weights(source, arch)
    (tmp_path / "config.json").write_text(json.dumps(arch.hf_config("float32")))
    save_file(weights, tmp_path / "model.safetensors")
    for load in (lambda: load_weights(model, arch, weights), lambda: load_init(model, arch, str(tmp_path))):
        model.layers["0"].attention.qkv_linear.wq.base_layer.weight.data.zero_()
        load()
        base = dict(base_tensors(model))
        assert all(torch.equal(base[name], value) for name, value in source.state_dict().items())
        assert all(torch.equal(value, adapters[name]) for name, value in adapter_tensors(model))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(SchemaError, match=r"missing \['layers.1.attention.qkv_linear.wk.weight'\], unexpected \[\]"):
        load_weights(model, arch, weights)


def lora_trainer(arch, weights: dict, config: LoraConfig, seed: int) -> PolicyTrainer:
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=seed, lora=config)
    load_weights(model, arch, weights)
    return PolicyTrainer(model, OptimConfig(lr=1e-2), LossConfig(tis="none"))


def batch(step: int, vocab_size: int) -> PolicyBatch:
    tokens, mask = tokens_and_mask(vocab_size, seed=step)
    return PolicyBatch(tokens, mask, torch.tensor([1.0, -1.0, 0.5]))


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_bit_for_bit(tmp_path):
    """Train 2 steps, checkpoint, 2 more; a trainer built anew (its base from the same weights, other
    adapters) loads the checkpoint and takes the same 2 steps: identical losses and adapters (with dropout:
    the generators are restored too)."""
    arch, config = get_model("qwen3-tiny"), LoraConfig(rank=4, dropout=0.1)
    weights = hf_weights(build_model(arch, ParallelConfig(), device="cpu", seed=3)[0], arch)
    trainer = lora_trainer(arch, weights, config, seed=0)
    for step in range(2):
        trainer.step(batch(step, arch.vocab_size))
    path = checkpoint.save(tmp_path, 2, trainer, {"version": 2})
    trained = [trainer.step(batch(step, arch.vocab_size))["loss"] for step in (2, 3)]

    anew = lora_trainer(arch, weights, config, seed=7)
    assert checkpoint.load(path, anew) == {"version": 2}
    assert [anew.step(batch(step, arch.vocab_size))["loss"] for step in (2, 3)] == trained
    resumed = dict(adapter_tensors(anew.model))
    assert all(torch.equal(value, resumed[name]) for name, value in adapter_tensors(trainer.model))

    entries = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = [key for key in entries if key.startswith(("model.", "optim.state."))]
    assert saved and all(".lora_A." in key or ".lora_B." in key for key in saved), "the adapters and their state only"


def test_a_checkpoint_resumes_only_the_model_it_was_saved_from(tmp_path):
    arch = get_model("qwen3-tiny")
    weights = hf_weights(build_model(arch, ParallelConfig(), device="cpu", seed=3)[0], arch)
    lora = checkpoint.save(tmp_path / "lora", 1, lora_trainer(arch, weights, LoraConfig(rank=4), seed=0), {})
    plain, _ = build_model(arch, ParallelConfig(), device="cpu")
    full = checkpoint.save(tmp_path / "full", 1, PolicyTrainer(plain, OptimConfig(), LossConfig()), {})
    for path, trainer, differs in [
        (
            lora,
            lora_trainer(arch, weights, LoraConfig(rank=8), seed=0),
            "layers.0.attention.qkv_linear.wk.lora_A.weight saved (4, 64), here (8, 64)",
        ),
        (lora, lora_trainer(arch, weights, LoraConfig(rank=4, targets=("wq", "wk")), seed=0), "entries differ"),
        (lora, PolicyTrainer(plain, OptimConfig(), LossConfig()), "weight saved None, here ("),
        (full, lora_trainer(arch, weights, LoraConfig(rank=4), seed=0), "entries differ"),
    ]:
        with pytest.raises(SchemaError, match=f"checkpoint {path}: its model does not fit the trainer's") as error:
            checkpoint.load(path, trainer)
        assert differs in str(error.value)
        assert trainer.steps == 0


def test_a_model_is_adapted_once():
    model, _ = build_model(get_model("qwen3-tiny"), ParallelConfig(), device="cpu", lora=LoraConfig())
    with pytest.raises(SchemaError, match="apply_lora: the model already has adapters"):
        apply_lora(model, LoraConfig())


@pytest.mark.slow  # torch.compile on the CPU
def test_compiled_blocks_give_their_adapters_the_gradients_eager_ones_do():
    arch, config = get_model("qwen3-tiny"), LoraConfig(rank=4, targets=("wq", "wo", "w1"))
    parallel = ParallelConfig(compile=True, activation_checkpoint="selective")
    compiled, _ = build_model(arch, parallel, device="cpu", dtype="bfloat16", seed=2, lora=config)
    eager, _ = build_model(arch, ParallelConfig(), device="cpu", dtype="bfloat16", seed=2, lora=config)
    tokens, mask = tokens_and_mask(arch.vocab_size)
    grads = []
    for model in (compiled, eager):
        for p in model.parameters():  # B at 0 would give A no gradient
            if p.requires_grad:
                p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(p.numel()))
        (forward_logits(model, tokens).float().log_softmax(-1).amax(-1) * mask).sum().backward()
        names = {name: name.replace("._checkpoint_wrapped_module", "") for name, _ in model.named_parameters()}
        grads.append({names[name]: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() == {n for n, p in eager.named_parameters() if p.requires_grad}
    for name, grad in grads[0].items():
        error = ((grad - grads[1][name]).norm() / grads[1][name].norm()).item()
        assert error < 0.05, f"{name}: relative error {error:.3f}"
