"""`meshy sample RUN_DIR PROMPT...`: a run's trained weights answer prompts, on the CPU.

The weights are the run's final_weights (its last version), or with --version N one the run kept as an HF
directory (a LoRA run's: a PEFT adapter directory on the base it names): weights/vN (disk publishing keeps the
newest few) or hf_versions/vN (recipe.hf_every). The model, dtype and tokenizer are the recipe's (the run
directory's recipe.toml); each prompt is asked as the task asks its questions (in its chat template:
task_prompt) and answered by the pure-torch engine, greedily unless --temperature says otherwise.
"""

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

from meshy.dataplane import SchemaError
from meshy.dataplane.hf_directory import ADAPTER_CONFIG, CONFIG
from meshy.dataplane.model_source import read_adapter_directory
from meshy.infer.engine import SamplingParams
from meshy.infer.torch_engine import TorchEngine
from meshy.recipes.recipe import Recipe, load_recipe
from meshy.recipes.usercode.held_out import response_text
from meshy.recipes.usercode.imports import import_beside, import_object

# A run directory's entries, as meshy.recipes.launch.run and meshy.recipes.roles.training name them (not imported
# from there: they import torch.distributed and torchtitan, seconds before the first answer)
RECIPE_FILE = "recipe.toml"
FINAL = "final_weights"  # the last version
PUBLISHED = "weights"  # the newest versions disk publishing keeps
KEPT = "hf_versions"  # every hf_every-th version


@dataclass(frozen=True)
class Answer:
    prompt: str
    completion: str


def kept_versions(run_dir: Path, recipe: Recipe) -> dict[int, Path]:
    """Every weights version the run kept as an HF directory, by version; the final weights are the
    recipe's last version (training writes them once it has trained `steps` versions)."""
    versions = {}
    for kept in (run_dir / PUBLISHED, run_dir / KEPT):
        for directory in kept.glob("v[0-9]*"):
            if directory.name[1:].isdigit() and _holds_weights(directory):
                versions[int(directory.name[1:])] = directory
    if _holds_weights(run_dir / FINAL):
        versions[recipe.steps] = run_dir / FINAL
    return dict(sorted(versions.items()))


def _holds_weights(directory: Path) -> bool:
    """An HF model directory, or a LoRA run's PEFT adapter directory."""
    return (directory / CONFIG).is_file() or (directory / ADAPTER_CONFIG).is_file()


def weights_of(run_dir: Path, recipe: Recipe, version: int | None) -> tuple[int, Path]:
    """The version asked for (None: the final weights) and its directory, or an error listing what exists."""
    versions = kept_versions(run_dir, recipe)
    listed = ", ".join(map(str, versions)) or "none"
    if version is None:
        if not _holds_weights(run_dir / FINAL):
            raise SchemaError(
                f"sample: {run_dir} has no {FINAL}/ (the run stopped before its last version, "
                f"{recipe.steps}); kept versions, for --version N: {listed}"
            )
        return recipe.steps, run_dir / FINAL
    if version not in versions:
        raise SchemaError(
            f"--version {version}: {run_dir} kept no weights of version {version}; kept versions: {listed} "
            f"(the final weights, the newest few of weights/ and every hf_every-th version in {KEPT}/)"
        )
    return version, versions[version]


def task_prompt(recipe: Recipe, question: str) -> str:
    """A question asked as the recipe's task asks its own: by the `ask(question, **options)` function of its
    problems' module (a chat template, a system message, an instruction), or as given where there is none
    (the default's arithmetic, whose prompts are the bare `3+4=`)."""
    problems = import_object(recipe.task.problems, "task.problems")
    ask = getattr(sys.modules[problems.__module__], "ask", None)
    return question if ask is None else ask(question, **recipe.task.options)


def sample(
    run_dir: str | Path,
    prompts: list[str],
    version: int | None = None,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
) -> tuple[str, list[Answer]]:
    """What the run's weights answer to each prompt, with a line saying which weights answered and how."""
    run_dir = Path(run_dir)
    if not (run_dir / RECIPE_FILE).is_file():
        raise SchemaError(f"sample: {run_dir} is not a run directory (no {RECIPE_FILE})")
    recipe = load_recipe(run_dir / RECIPE_FILE)
    import_beside(run_dir / RECIPE_FILE)
    version, weights = weights_of(run_dir, recipe, version)
    budget = recipe.sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
    params = SamplingParams(budget, temperature=temperature)  # its own checks name a bad value
    tokenizer = import_object(recipe.task.tokenizer, "task.tokenizer")(**recipe.task.tokenizer_options)
    inputs = [tokenizer.encode(task_prompt(recipe, prompt)) for prompt in prompts]
    positions = recipe.model.arch().max_position_embeddings
    longest = max(len(ids) for ids in inputs) + budget
    if longest > positions:
        raise SchemaError(
            f"--max-new-tokens: a prompt's tokens and {budget} new ones make {longest}, beyond the {positions} "
            f"positions of model {recipe.model.name!r}; expected fewer"
        )
    source, adapter = weights, None
    if (weights / ADAPTER_CONFIG).is_file():  # a LoRA run's version: the adapters on the base they name
        config, tensors, adapter = read_adapter_directory(weights)
        source = (config, tensors)
    engine = TorchEngine(
        source,
        max_running=len(inputs),
        max_len=longest,
        device="cpu",
        dtype=recipe.model.dtype,
        version=version,
        adapter=adapter,
    )
    outputs = asyncio.run(_generate(engine, inputs, params))
    how = "greedy" if temperature == 0 else f"temperature {temperature}"
    header = f"meshy: {run_dir.name}: weights v{version} ({weights}), {how}, at most {budget} new tokens"
    answers = [Answer(p, response_text(tokenizer, ids)) for p, ids in zip(prompts, outputs, strict=True)]
    return header, answers


async def _generate(engine: TorchEngine, inputs: list[list[int]], params: SamplingParams) -> list[list[int]]:
    try:
        generations = await asyncio.gather(
            *(engine.generate(f"sample/{i}", ids, params) for i, ids in enumerate(inputs))
        )
    finally:
        await engine.close()
    return [g.output_ids for g in generations]
