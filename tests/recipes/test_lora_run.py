"""A LoRA run end to end, in real processes: the default recipe with [model.lora] trains the adapters only,
publishes every version as its adapters on each transport (the engine applies them on the base it holds),
and leaves in final_weights/ a PEFT adapter on the base it names, with the merged model beside it, which
`peft` and `meshy sample` load; a resumed run restores the adapters onto the recipe's base."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshy.dataplane.model_source import read_model
from meshy.recipes.observe.sample import sample
from tests.recipes.test_pipeline import GROUP, GROUPS, check_run, records, repo_env, run, small_recipe

STEPS = 4
LORA = '\n[model.lora]\nrank = 4\nalpha = 8.0\ntargets = ["wq", "wv", "w2"]\nmerge_final = true\n'
ADAPTED = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")  # the HF modules of wq, wv, w2


def lora_run(tmp_path: Path, publish: str) -> Path:
    recipe = small_recipe(tmp_path, "1", top=f'publish = "{publish}"\n', tail=LORA, steps=STEPS)
    recipe.write_text(recipe.read_text().replace("checkpoint_every = 100", f"checkpoint_every = {STEPS}"))
    return run(recipe)


def base_of(final: Path) -> Path:
    return Path(json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"])


def check_lora_run(run_dir: Path) -> None:
    """The run trained every version on its adapters, which travelled alone, and left them in final_weights/
    on the base it names, with the merged model in final_weights/merged/."""
    metrics = check_run(run_dir, 0, steps=STEPS)
    assert all(m["rows_trained"] == GROUPS * GROUP for m in metrics)
    final = run_dir / "final_weights"
    adapters = load_file(final / "adapter_model.safetensors")
    assert {name.split(".")[-4] + "." + name.split(".")[-3] for name in adapters} == set(ADAPTED)
    assert all(t.abs().max() > 0 for name, t in adapters.items() if "lora_B" in name), "B starts at 0 and trained"
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    for m in metrics:  # each version travelled as its adapters (and a few bytes of header or alignment)
        assert adapter_bytes <= m["weights_bytes"] <= adapter_bytes + 4096, (m["version"], m["weights_bytes"])
    assert records(run_dir, "inference-0")[-1]["versions"][-1] == STEPS
    _, base = read_model(base_of(final))
    _, merged = read_model(final / "merged")
    assert adapter_bytes < 0.05 * sum(t.numel() * t.element_size() for t in base.values())
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    assert changed == {f"model.layers.{i}.{module}.weight" for i in range(2) for module in ADAPTED}


def test_a_lora_run_publishes_adapters_that_peft_and_meshy_sample_load_onto_their_base(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    run_dir = lora_run(tmp_path, "disk")
    check_lora_run(run_dir)
    final = run_dir / "final_weights"
    assert base_of(final) == (run_dir / "weights" / "base").resolve()
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_of(final)), final)
    merged = model.merge_and_unload().state_dict()
    _, ours = read_model(final / "merged")
    assert all(torch.allclose(merged[name], tensor, atol=1e-6) for name, tensor in ours.items())
    header, answers = sample(run_dir, ["3+4="])
    assert f"weights v{STEPS} ({final})" in header and len(answers) == 1


@pytest.mark.slow  # the default tier runs the disk transport's, the shipped LoRA recipe's miniature shared memory
def test_a_lora_run_broadcasting_its_versions_trains_the_adapters_and_resumes_them(tmp_path):
    run_dir = lora_run(tmp_path, "collective")
    check_lora_run(run_dir)
    # Resumed from its last checkpoint (the adapters and their optimizer state): the base is the recipe's
    # again, and the restored version's adapters are the ones it had.
    final = run_dir / "final_weights"
    saved = load_file(final / "adapter_model.safetensors")
    command = [sys.executable, "-m", "meshy.recipes.cli", "run", "--resume", str(run_dir)]
    resumed = subprocess.run(command, env=repo_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert f"version {STEPS} (the newest checkpoint's) published" in resumed.stdout
    again = load_file(final / "adapter_model.safetensors")
    assert again.keys() == saved.keys() and all(torch.equal(again[k], saved[k]) for k in saved)
