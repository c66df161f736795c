"""Hugging Face TRL's GRPOTrainer on a Meshy job, for side-by-side comparison with Meshy's own run.

    uv run python bench/trl_grpo.py --job default --seed 0 --steps 800 --out DIR [--threads 2]
    uv run python bench/trl_grpo.py --job recipe --recipe RECIPE.toml [--seed S] [--steps N] --out DIR

Writes DIR/steps.jsonl, one line per optimizer step ({"step", "time", "reward_mean", "samples", and TRL's own
step metrics: loss, grad_norm, entropy, frac_reward_zero_std, ...}) and, with held-out evaluation, one line
per evaluated step ({"step", "time", "eval/accuracy", ["eval/pass@k",] "eval/reward", "eval/problems",
"eval/seconds"}; step 0: the initial weights); and DIR/summary.json (startup_s = time of step 1's end,
total_s, steps, steps_to_target: the first step whose last-20-step mean reward is >= 0.9, or null,
last20_mean, steps_per_s after step 1, eval_first/eval_best/eval_last, excluded_s, t0_unix).
Every `time` is seconds since this script started less the seconds it spent on held-out evaluation and on
its own equivalence checks (`excluded_s`): work TRL's training does not do.

A job is one `Job`: the initial HF model directory, the tokenizer, the training problems in order, the
reward functions, the GRPOConfig fields mirrored from the recipe and, optionally, a held-out set;
everything else (the Meshy-equivalent GRPO settings, logging, the summary) is shared.

`default` is Meshy's embedded default recipe (packages/meshy-recipes/src/meshy/recipes/default.toml) with
Meshy's version-0 weights of the seed, its character tokenizer wrapped as an HF fast tokenizer with the very
same ids, the problems its rollout role draws (seed * 1000 + 0) in order, and its exact-match reward on the
response decoded up to EOS.

`recipe` is any single-turn GRPO recipe whose tokenizer is meshy.recipes.tasks.hf_tokenizer:tokenizer and
whose model.init is pretrained (e.g. gguf:smollm2-135m-instruct): its weights (float32, trained in
model.dtype: bfloat16 is accelerate's CPU autocast over float32 weights, as Meshy's trainer), tokenizer.json
with the ids of Meshy's HFTokenizer (no special token added; eos from config.json), the problems Meshy's
rollout process 0 draws (held-out ones left out), task.reward on the response decoded up to EOS, the
algorithm's settings (a setting TRL cannot mirror is refused, naming the field; TRL is on-policy whatever
algorithm.pacing says; algorithm.tied_group_penalty is applied to TRL's advantages over each step's groups
with Meshy's own push_tied_groups), and, with an [eval] section, Meshy's held-out evaluation at steps 0, every
eval.every-th and the last (HF generate on the trained model, prompts left-padded in batches of
sampling.max_in_flight). --seed and --steps replace the recipe's.

--threads sets torch.set_num_threads. The default job's model is tiny: on a host whose cores other jobs also
use, one thread is far faster (about 10 steps/s on 2 busy cores) than two (about 0.25 steps/s: the threads
wait on each other), and the learning is the same.

--meshy-sampler (an experiment): draw completions as Meshy's torch engine does (meshy.infer.sampling: the
uniform of a row's k-th token is a hash of (row seed, k), row seed = (seed * 1000) * 1_000_003 + row id, row
id = step * rows per step + row), with the policy TRL trains, through TRL's rollout_func; with the same
weights Meshy's run and this one then draw the same tokens, so they differ only by float noise.

--meshy-skip (an experiment, not TRL's behaviour): take no optimizer step when every advantage of the step
is 0, unless the step's mean reward is below the best so far (Meshy's `explore`), as Meshy's trainer does.
"""

# ruff: noqa: E402 (the imports follow T0 on purpose)
import time

T0 = time.perf_counter()  # the script's clock: its first statement, before any heavy import
T0_UNIX = time.time()


import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TARGET, WINDOW = 0.9, 20


@dataclass
class HeldOut:
    """A recipe's held-out evaluation as Meshy's eval role runs it: the problems, the recipe's tokenizer (prompt
    ids, response text) and reward."""

    recipe: Any  # meshy.recipes.recipe.Recipe, with the run's steps
    problems: list
    tokenizer: Any
    reward: Callable[[str, str], float]


@dataclass
class Job:
    """What differs between jobs. `config` holds the job's own GRPOConfig fields (they override the shared
    ones); `check` runs the job's equivalence checks once the trainer exists (it gets the trainer)."""

    name: str
    model_dir: Path
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    train_dataset: Any  # a datasets.Dataset, in the order it is to be trained on
    reward_funcs: list[Callable]
    config: dict[str, Any] = field(default_factory=dict)
    check: Callable[[Any], None] | None = None
    held_out: HeldOut | None = None
    tied_group_penalty: float = 0.0  # algorithm.tied_group_penalty, applied over each step's groups


class Clock:
    """The script's clock: seconds since T0 less the seconds excluded so far (held-out evaluation, the
    equivalence checks), by kind."""

    def __init__(self):
        self.excluded: dict[str, float] = {}

    def now(self) -> float:
        return time.perf_counter() - T0 - sum(self.excluded.values())

    @contextlib.contextmanager
    def excluding(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.excluded[kind] = self.excluded.get(kind, 0.0) + time.perf_counter() - start


# ---- shared by the jobs: what a recipe says, as TRL's settings ---------------------------------------------
def refuse_unmirrored(recipe) -> None:
    """Fail, naming the field, on a recipe setting that TRL's GRPOTrainer (as configured here) cannot mirror."""
    algo, loss, sampling, optim = recipe.algorithm, recipe.algorithm.loss, recipe.sampling, recipe.algorithm.optim
    mirrored = [
        ("algorithm.kind", algo.kind, algo.kind == "grpo"),
        ("algorithm.loss.kl_coef", loss.kl_coef, loss.kl_coef == 0),  # beta 0: no reference model
        ("algorithm.loss.tis", loss.tis, loss.tis == "none"),
        ("algorithm.minibatches", algo.minibatches, algo.minibatches == 1),
        ("algorithm.epochs", algo.epochs, algo.epochs == 1),
        ("algorithm.loss.aggregation", loss.aggregation, loss.aggregation == "token_mean"),
        ("algorithm.loss.pg_coef", loss.pg_coef, loss.pg_coef == 1),
        ("algorithm.loss.dual_clip", loss.dual_clip, loss.dual_clip == 0),
        ("algorithm.loss.distill_coef", loss.distill_coef, loss.distill_coef == 0),
        # TRL computes logprobs at the sampling temperature
        ("algorithm.loss.temperature", loss.temperature, loss.temperature == sampling.temperature),
        ("algorithm.dynamic_sampling", algo.dynamic_sampling, not algo.dynamic_sampling),
        ("algorithm.overlong_buffer", algo.overlong_buffer, algo.overlong_buffer == 0),
        ("algorithm.routing_replay", algo.routing_replay, not algo.routing_replay),
        # HF's warm-up starts at lr 0, Meshy's at lr / warmup_steps
        ("algorithm.optim.warmup_steps", optim.warmup_steps, optim.warmup_steps == 0),
        ("sampling.temperature", sampling.temperature, sampling.temperature > 0),
        ("task.environment", recipe.task.environment, not recipe.task.environment),
        # one problem stream, seed * 1000 + 0
        ("roles.rollout.processes", recipe.roles.rollout.processes, recipe.roles.rollout.processes == 1),
        ("roles.custom", recipe.roles.custom, not recipe.roles.custom),
    ]
    for name, value, ok in mirrored:
        assert ok, f"{name} = {value!r}: TRL's GRPOTrainer cannot mirror it here"


def recipe_grpo_fields(recipe) -> dict[str, Any]:
    """The GRPOConfig fields a recipe sets: one generation batch (group_size * prompts_per_step completions)
    is one optimizer step."""
    algo, sampling, loss, optim = recipe.algorithm, recipe.sampling, recipe.algorithm.loss, recipe.algorithm.optim
    return dict(
        num_generations=algo.group_size,
        per_device_train_batch_size=algo.group_size * algo.prompts_per_step,  # completions per step
        max_completion_length=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,  # 0: no top-k truncation, in both
        learning_rate=optim.lr,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_epsilon=optim.eps,
        weight_decay=optim.weight_decay,
        max_grad_norm=optim.max_grad_norm,
        epsilon=loss.clip_low,
        epsilon_high=loss.clip_high,
        entropy_coef=loss.entropy_coef,
        scale_rewards="group" if algo.scale_by_std else "none",
        bf16=recipe.model.dtype == "bfloat16",  # accelerate: torch.autocast("cpu", bfloat16) over float32 weights
    )


def meshy_reward(reward: Callable[[str, str], float], tokenizer) -> Callable[..., list[float]]:
    """A TRL reward function scoring as Meshy's rollout role: `reward(text, ground truth)` on the response
    decoded up to EOS (meshy.recipes.usercode.held_out.response_text)."""
    from meshy.recipes.usercode.held_out import response_text

    def meshy_reward(completion_ids, ground_truth, **_):
        return [
            float(reward(response_text(tokenizer, list(ids)), truth))
            for ids, truth in zip(completion_ids, ground_truth, strict=True)
        ]

    return meshy_reward


def check_problem_order(recipe, trainer) -> int:
    """TRL takes the problems in order, each repeated group_size times consecutively, prompts_per_step groups
    per step; the rows per step."""
    algo = recipe.algorithm
    per_step = algo.group_size * algo.prompts_per_step
    head = list(trainer._get_train_sampler())[: 2 * per_step]
    expected = [i for i in range(2 * algo.prompts_per_step) for _ in range(algo.group_size)]
    assert head == expected[: len(head)], "TRL does not take the problems in order"
    assert trainer.args.generation_batch_size == per_step and trainer.args.steps_per_generation == 1
    return per_step


# ---- the default job: Meshy's embedded default recipe ----------------------------------------------------
def char_tokenizer_as_hf():
    """meshy.recipes.tasks.arithmetic.CharTokenizer as a transformers fast tokenizer with the same ids:
    0 <pad>, 1 <bos>, 2 <eos>, then one id per character; encoding prepends BOS (as CharTokenizer.encode),
    decoding joins characters and, with skip_special_tokens, drops pad/bos/eos (as CharTokenizer.decode)."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from meshy.recipes.tasks import arithmetic

    specials = ["<pad>", "<bos>", "<eos>"]
    assert [arithmetic.PAD, arithmetic.BOS, arithmetic.EOS] == [0, 1, 2]
    vocab = {s: i for i, s in enumerate(specials)} | {c: arithmetic._FIRST + i for i, c in enumerate(arithmetic._CHARS)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))  # no <unk>: an unknown character fails, as in Meshy
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        padding_side="left",
        model_max_length=512,
    )


def meshy_initial_weights(recipe, seed: int, root: Path) -> Path:
    """Meshy's version 0 of `recipe` for `seed` (what its training role builds and publishes), as an HF
    directory root/v000000; reused if already there."""
    final = root / "v000000"
    if (final / "model.safetensors").is_file():
        return final
    from meshy.train.parallel import build_model
    from meshy.train.publish import DirectoryPublisher
    from meshy.train.training_config import ParallelConfig

    arch = recipe.model.arch()
    model, _ = build_model(arch, ParallelConfig(), device="cpu", dtype="float32", seed=seed)
    DirectoryPublisher(root, arch, None, dtype="float32").publish(model, 0)
    return final


def check_default_equivalence(recipe, seed: int, model_dir: Path, tokenizer, trainer) -> None:
    """The TRL side's model, tokens, problem order and reward are Meshy's."""
    import torch
    from transformers import AutoModelForCausalLM

    from meshy.recipes.tasks.arithmetic import CharTokenizer
    from meshy.recipes.usercode.held_out import response_text
    from meshy.train.logprobs import forward_logits
    from meshy.train.parallel import build_model
    from meshy.train.training_config import ParallelConfig

    # Weights: HF logits of the published directory = Meshy's own model's, fp32; embeddings tied in both.
    arch = recipe.model.arch()
    meshy_model, _ = build_model(arch, ParallelConfig(), device="cpu", dtype="float32", seed=seed)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM", type(hf)
    assert arch.tie_word_embeddings and hf.config.tie_word_embeddings
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr(), "HF lm_head not tied"
    assert meshy_model.lm_head.weight.data_ptr() == meshy_model.tok_embeddings.weight.data_ptr(), "Meshy not tied"
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, arch.vocab_size, (8, 9), generator=g)
    tokens[:, 0] = 1
    with torch.no_grad():
        ours = forward_logits(meshy_model, tokens)
        theirs = hf(tokens[:, :-1]).logits.float()
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-4, f"HF and Meshy logits differ by {diff}"
    trained = trainer.model  # the very model TRL trains: same weights as the directory
    with torch.no_grad():
        trl_logits = trained(input_ids=tokens[:, :-1]).logits.float()
    diff_trl = (ours - trl_logits).abs().max().item()
    assert diff_trl < 1e-4, f"TRL's model and Meshy differ by {diff_trl}"

    # Tokens: the ids TRL feeds the model are CharTokenizer's, BOS first; pad 0, eos 2; decoding as Meshy's.
    char = CharTokenizer()
    prompts = ["3+4=", "0+0=", "4+4=", "12+3=", "9*9="]
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1
    assert trainer._tokenizer.pad_token_id == 0 and trainer.eos_token_ids[0] == 2, trainer.eos_token_ids
    assert set(trainer.eos_token_ids) == {2}, f"generation stops at ids {trainer.eos_token_ids}, not only EOS"
    ids, _, _ = trainer._tokenize_prompts(prompts)  # exactly how GRPOTrainer 1.16 tokenizes text prompts
    assert [list(i) for i in ids] == [char.encode(p) for p in prompts], (ids, [char.encode(p) for p in prompts])
    # TRL cuts a completion after its first EOS (kept); its decoded text must be what Meshy scores.
    for response in ([10, 2], [4, 5, 2], [2], [4, 5, 6], [1, 10, 2], [3, 0, 2], [10, 7, 2]):
        assert tokenizer.decode(response, skip_special_tokens=True) == response_text(char, response), response

    # Problems: in Meshy's order, each repeated group_size times consecutively, 32 prompts per step.
    per_step = check_problem_order(recipe, trainer)
    print(
        f"checks: HF logits = Meshy logits (max |diff| {diff:.2e}, TRL's model {diff_trl:.2e}), tied embeddings, "
        f"prompt ids = CharTokenizer ids {ids[0]}, problems in order ({per_step} rows per step)",
        flush=True,
    )


def default_job(seed: int, steps: int, out: Path) -> Job:
    from datasets import Dataset

    from meshy.recipes.recipe import DEFAULT_RECIPE, load_recipe
    from meshy.recipes.tasks.arithmetic import CharTokenizer
    from meshy.recipes.usercode.imports import import_object

    recipe = dataclasses.replace(load_recipe(DEFAULT_RECIPE), seed=seed, steps=steps)
    algo = recipe.algorithm
    # The recipe this job mirrors; refuse to run if it changed under us.
    refuse_unmirrored(recipe)
    assert (algo.group_size, algo.prompts_per_step, algo.pacing, algo.loss.temperature) == (8, 32, 1, 1.0), algo
    assert algo.scale_by_std and recipe.model.dtype == "float32" and recipe.eval is None, recipe

    model_dir = meshy_initial_weights(recipe, seed, out / "init")
    tokenizer = char_tokenizer_as_hf()
    rows = recipe_problems(recipe, [], steps * algo.prompts_per_step)
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in rows], "ground_truth": [p.answer for p in rows]})
    reward = meshy_reward(import_object(recipe.task.reward, "task.reward"), CharTokenizer())
    job = Job("default", model_dir, tokenizer, dataset, [reward], recipe_grpo_fields(recipe))
    job.check = lambda trainer: check_default_equivalence(recipe, seed, model_dir, tokenizer, trainer)
    return job


# ---- the recipe job: a single-turn GRPO recipe with pretrained weights and an HF tokenizer.json ----------
HF_TOKENIZER = "meshy.recipes.tasks.hf_tokenizer:tokenizer"


def hf_tokenizer_as_fast(directory: Path, eos: int, context_length: int):
    """The model directory's tokenizer.json as a transformers fast tokenizer with the ids of Meshy's
    HFTokenizer: no post-processor, so encoding adds no special token whatever add_special_tokens says (as
    HFTokenizer.encode(add_special_tokens=False)); eos (config.json's) also pads, prompts on the left."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.post_processor = None
    eos_token = backend.id_to_token(eos)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=eos_token,
        pad_token=eos_token,
        padding_side="left",
        model_max_length=context_length,
    )


def recipe_problems(recipe, held_out: list, count: int) -> list:
    """The first `count` problems Meshy's rollout process 0 writes: problems(seed * 1000 + 0, **options),
    without the held-out ones when the recipe evaluates."""
    from meshy.recipes.usercode.held_out import WithoutHeldOut
    from meshy.recipes.usercode.imports import import_object

    stream = import_object(recipe.task.problems, "task.problems")(recipe.seed * 1000 + 0, **recipe.task.options)
    if recipe.eval is not None:
        stream = WithoutHeldOut(stream, held_out)
    return list(itertools.islice(stream, count))


def check_recipe_equivalence(recipe, meshy_tokenizer, prompts: list[str], trainer) -> None:
    """The TRL side's model, tokens, problem order and precision are Meshy's."""
    import torch

    from meshy.recipes.weights.pretrained import load_init
    from meshy.train.logprobs import forward_logits
    from meshy.train.parallel import build_model
    from meshy.train.training_config import ParallelConfig

    # Weights: the model TRL trains gives the logits of Meshy's version 0 (model.init loaded by its trainer).
    ids = [meshy_tokenizer.encode(p) for p in prompts[:4]]
    width = min(map(len, ids))
    tokens = torch.tensor([i[:width] for i in ids])
    arch = recipe.model.arch()
    diffs = {}
    for dtype in ("float32", recipe.model.dtype):
        meshy_model, _ = build_model(arch, ParallelConfig(), device="cpu", dtype=dtype, seed=recipe.seed)
        load_init(meshy_model, arch, recipe.model.init)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            ours = forward_logits(meshy_model, tokens)
            theirs = trainer.model(input_ids=tokens[:, :-1]).logits.float()
        diffs[dtype] = (ours - theirs).abs().max().item()
        del meshy_model
    assert diffs["float32"] < 1e-3, f"TRL's model and Meshy's version 0 differ by {diffs['float32']} (float32)"
    mixed = recipe.model.dtype == "bfloat16"
    assert trainer.args.bf16 == mixed and trainer.accelerator.native_amp == mixed, "not the recipe's precision"

    # Tokens: TRL's prompt ids are HFTokenizer.encode's; generation stops at config.json's eos only.
    trl_ids, _, _ = trainer._tokenize_prompts(prompts[:4])  # exactly how GRPOTrainer 1.16 tokenizes text prompts
    assert [list(i) for i in trl_ids] == ids, "TRL's prompt ids are not HFTokenizer.encode's"
    assert trainer.eos_token_ids == [meshy_tokenizer.eos_token_id], trainer.eos_token_ids

    per_step = check_problem_order(recipe, trainer)
    print(
        f"checks: TRL's model = Meshy's version 0 (max |logit diff| float32 {diffs['float32']:.2e}, "
        f"{recipe.model.dtype} {diffs[recipe.model.dtype]:.2e}), prompt ids = HFTokenizer ids ({len(ids[0])} "
        f"tokens: {ids[0][:8]}...), eos {trainer.eos_token_ids}, problems in order ({per_step} rows per step), "
        f"mixed precision {trainer.accelerator.mixed_precision}",
        flush=True,
    )


def recipe_job(path: Path, seed: int, steps: int) -> Job:
    from datasets import Dataset

    from meshy.recipes.recipe import load_recipe
    from meshy.recipes.usercode.held_out import held_out_problems
    from meshy.recipes.usercode.imports import import_object
    from meshy.recipes.weights.pretrained import SCRATCH, resolve

    recipe = dataclasses.replace(load_recipe(path), seed=seed, steps=steps)
    refuse_unmirrored(recipe)
    assert recipe.task.tokenizer == HF_TOKENIZER, f"task.tokenizer = {recipe.task.tokenizer!r}: expected {HF_TOKENIZER}"
    assert recipe.model.init != SCRATCH, "model.init = 'scratch': this job starts from pretrained weights"
    meshy_tokenizer = import_object(HF_TOKENIZER, "task.tokenizer")(**recipe.task.tokenizer_options)
    tokenizer = hf_tokenizer_as_fast(
        resolve(recipe.task.tokenizer_options["model"]), meshy_tokenizer.eos_token_id, recipe.sampling.context_length
    )
    reward = import_object(recipe.task.reward, "task.reward")
    held_out = held_out_problems(recipe) if recipe.eval is not None else []
    rows = recipe_problems(recipe, held_out, steps * recipe.algorithm.prompts_per_step)
    prompts = [p.prompt for p in rows]  # rendered chat text: TRL gets plain text, no chat template
    dataset = Dataset.from_dict({"prompt": prompts, "ground_truth": [p.answer for p in rows]})
    job = Job(
        "recipe",
        resolve(recipe.model.init),
        tokenizer,
        dataset,
        [meshy_reward(reward, meshy_tokenizer)],
        recipe_grpo_fields(recipe),
        tied_group_penalty=recipe.algorithm.tied_group_penalty,
    )
    job.check = lambda trainer: check_recipe_equivalence(recipe, meshy_tokenizer, prompts, trainer)
    if recipe.eval is not None:
        job.held_out = HeldOut(recipe, held_out, meshy_tokenizer, reward)
    return job


def build_job(name: str, recipe: Path | None, seed: int, steps: int, out: Path) -> Job:
    if name == "recipe":
        assert recipe is not None, "--job recipe needs --recipe"
        return recipe_job(recipe, seed, steps)
    assert recipe is None, "--recipe goes with --job recipe"
    return default_job(seed, steps, out)


def held_out_callback(held_out: HeldOut, clock: Clock, steps_file):
    """A TrainerCallback that evaluates the held-out set as Meshy's eval role does (roles/eval.py), on the
    trainer's model, at steps 0 (before training), every eval.every-th and the last; its time is excluded
    from the clock. Each answer: at most eval_max_new_tokens tokens, greedy (or eval.samples answers at
    eval.temperature, no truncation), scored by the recipe's reward on response_text; one line of figures
    (meshy.recipes.usercode.held_out.figures) per evaluated step in steps.jsonl."""
    import torch
    from transformers import GenerationConfig, TrainerCallback

    from meshy.recipes.usercode.held_out import evaluated, figures, response_text

    recipe, spec, tokenizer = held_out.recipe, held_out.recipe.eval, held_out.tokenizer
    prompts = [tokenizer.encode(p.prompt) for p in held_out.problems]
    requests = [i for i in range(len(prompts)) for _ in range(spec.samples)]  # a problem's answers together
    eos = tokenizer.eos_token_id
    sampled = spec.temperature > 0
    generation = GenerationConfig(
        max_new_tokens=recipe.eval_max_new_tokens,
        do_sample=sampled,
        **(dict(temperature=spec.temperature, top_p=1.0, top_k=0) if sampled else {}),
        eos_token_id=eos,
        pad_token_id=eos,
        disable_compile=True,
    )
    batch = recipe.sampling.max_in_flight  # the most answers Meshy's eval engine runs at once

    def answers(model) -> list[list[int]]:
        """Each request's response ids, prompts left-padded (masked) in batches."""
        out = []
        for start in range(0, len(requests), batch):
            ids = [prompts[i] for i in requests[start : start + batch]]
            width = max(map(len, ids))
            input_ids = torch.tensor([[eos] * (width - len(q)) + q for q in ids])
            mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in ids])
            generated = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=generation)
            out += [row[width:].tolist() for row in generated]
        return out

    def evaluate(model, step: int) -> None:
        at = clock.now()
        with clock.excluding("eval"):
            start = time.perf_counter()
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad():
                    outputs = answers(model)
            finally:
                model.train(was_training)
            rewards = [
                float(held_out.reward(response_text(tokenizer, ids), held_out.problems[i].answer))
                for i, ids in zip(requests, outputs, strict=True)
            ]
            grouped = [rewards[i * spec.samples : (i + 1) * spec.samples] for i in range(len(prompts))]
            result = figures(step, grouped, time.perf_counter() - start)
        line = {"step": step, "time": at} | {k: v for k, v in result.metrics().items() if k.startswith("eval/")}
        steps_file.write(json.dumps(line) + "\n")
        steps_file.flush()
        print(
            f"eval step {step}  accuracy {result.accuracy:.3f}  reward {result.reward:.3f}  "
            f"({result.problems} problems, {result.seconds:.0f}s, not counted)  [{at:.0f}s]",
            flush=True,
        )

    class HeldOutEval(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            evaluate(model, 0)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if evaluated(recipe, state.global_step):
                evaluate(model, state.global_step)

    return HeldOutEval()


def eval_summary(lines: list[dict]) -> dict:
    """First, best (the first of the best) and last held-out accuracy, with their steps."""
    evals = [line for line in lines if "eval/accuracy" in line]
    if not evals:
        return {}
    best = max(evals, key=lambda line: line["eval/accuracy"])
    return {
        f"eval_{name}": {"step": line["step"], "accuracy": line["eval/accuracy"]}
        for name, line in (("first", evals[0]), ("best", best), ("last", evals[-1]))
    }


# ---- shared: the GRPO settings that mirror Meshy's, logging, the run --------------------------------------
def grpo_config(job: Job, seed: int, steps: int, out: Path):
    from trl import GRPOConfig

    fields = dict(
        output_dir=str(out / "trainer"),
        seed=seed,
        data_seed=seed,
        max_steps=steps,
        # one generation batch = one optimizer step, generated by the weights of the step before (on-policy)
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        shuffle_dataset=False,
        min_p=None,
        repetition_penalty=1.0,
        beta=0.0,  # no KL, no reference model
        loss_type="dapo",  # sum of token losses / tokens in the (global, accumulated) batch = Meshy's token_mean
        scale_rewards="group",  # (r - group mean) / (unbiased group std + 1e-4); Meshy: + 1e-6
        importance_sampling_level="token",
        mask_truncated_completions=False,
        lr_scheduler_type="constant",
        optim="adamw_torch",  # torch.optim.AdamW, as Meshy's trainer
        use_cpu=True,
        fp16=False,
        gradient_checkpointing=False,
        disable_dropout=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    fields.update(job.config)
    return GRPOConfig(**fields)


class MeshySkip:
    """--meshy-skip: Meshy's trainer takes no step when every advantage is 0 unless the step's reward is below
    the best so far (explore). Set per step from the advantages; read by the optimizer's step."""

    def __init__(self):
        self.skip = False
        self.best = -math.inf
        self.skipped = 0


def steps_to_target(rewards: list[float]) -> int | None:
    for n in range(WINDOW, len(rewards) + 1):
        if sum(rewards[n - WINDOW : n]) / WINDOW >= TARGET:
            return n
    return None


def meshy_sampler(seed: int, temperature: float, max_new_tokens: int):
    """A TRL rollout_func sampling as Meshy's torch engine (see --meshy-sampler), on the trainer's model."""
    import torch

    from meshy.infer.sampling import Rows, sample

    calls = {"n": 0}

    @torch.no_grad()
    def rollout(prompts, trainer):
        model, tokenizer, eos_ids = trainer.model, trainer.processing_class, trainer.eos_token_ids
        prompt_ids = [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]
        n = len(prompt_ids)
        first = calls["n"] * n
        calls["n"] += 1
        seeds = torch.tensor([((seed * 1000) * 1_000_003 + first + i) % (1 << 63) for i in range(n)])
        outputs, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
        running = list(range(n))
        for k in range(max_new_tokens):
            if not running:
                break
            seqs = [prompt_ids[i] + outputs[i] for i in running]
            width = max(map(len, seqs))
            tokens = torch.tensor([q + [tokenizer.pad_token_id] * (width - len(q)) for q in seqs])
            last = torch.tensor([len(q) - 1 for q in seqs])
            logits = model(input_ids=tokens).logits.float()[torch.arange(len(seqs)), last]
            m = len(running)
            rows = Rows(
                temperature=torch.full((m,), float(temperature)),
                top_k=torch.full((m,), logits.shape[-1]),
                top_p=torch.ones(m),
                seed=seeds[running],
                counter=torch.full((m,), k),
                truncated=False,
            )
            chosen, chosen_logprobs = sample(logits, rows)
            for i, t, lp in zip(running, chosen.tolist(), chosen_logprobs.tolist(), strict=True):
                outputs[i].append(t)
                logprobs[i].append(lp)
            running = [i for i in running if outputs[i][-1] not in eos_ids]
        return {"prompt_ids": prompt_ids, "completion_ids": outputs, "logprobs": logprobs}

    return rollout


def run(
    job_name: str,
    seed: int,
    steps: int,
    out: Path,
    threads: int = 2,
    meshy_skip: bool = False,
    meshy_sampling: bool = False,
    recipe: Path | None = None,
) -> dict:
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOTrainer

    hf_logging.disable_progress_bar()
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    job = build_job(job_name, recipe, seed, steps, out)
    args = grpo_config(job, seed, steps, out)
    model = AutoModelForCausalLM.from_pretrained(job.model_dir, dtype=torch.float32)
    steps_path = out / "steps.jsonl"
    steps_file = steps_path.open("w")
    rewards: list[float] = []
    scored = {"samples": 0}
    skip = MeshySkip() if meshy_skip else None

    def counting(func):
        def reward(completions, **kwargs):
            scored["samples"] += len(completions)
            scored["last"] = func(completions=completions, **kwargs)
            return scored["last"]

        reward.__name__ = getattr(func, "__name__", "reward")
        return reward

    class StepLog(TrainerCallback):
        pending: dict | None = None

        def on_step_end(self, args, state, control, **kwargs):
            self.pending = {"step": state.global_step, "time": clock.now()}

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if self.pending is None or "reward" not in logs:
                return
            line = self.pending | {"reward_mean": logs["reward"], "samples": scored["samples"]}
            for key in (
                "loss",
                "grad_norm",
                "entropy",
                "reward_std",
                "frac_reward_zero_std",
                "completions/mean_length",
                "clip_ratio/region_mean",
                "learning_rate",
            ):
                if key in logs:
                    line[key] = logs[key]
            if skip is not None:
                line["stepped"] = not skip.skip
                line["skipped_total"] = skip.skipped
            scored["samples"] = 0
            self.pending = None
            rewards.append(line["reward_mean"])
            steps_file.write(json.dumps(line) + "\n")
            steps_file.flush()
            n = line["step"]
            if n == 1 or n % 50 == 0:
                recent = rewards[-WINDOW:]
                print(
                    f"step {n}  reward {line['reward_mean']:.3f}  mean of last {len(recent)} "
                    f"{sum(recent) / len(recent):.3f}  [{line['time']:.0f}s]",
                    flush=True,
                )

    callbacks = [StepLog()]  # first: a step's time is taken before it is evaluated
    if job.held_out is not None:
        callbacks.append(held_out_callback(job.held_out, clock, steps_file))
    trainer_cls = GRPOTrainer
    optimizers = (None, None)
    if job.tied_group_penalty:
        trainer_cls = _tied_group_pushing_trainer(trainer_cls, job.tied_group_penalty, scored, args.num_generations)
    if skip is not None:
        trainer_cls = _skipping_trainer(trainer_cls, skip)
        optimizers = (_skipping_adamw(model, args, skip), None)
    if meshy_sampling:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16
    trainer = trainer_cls(
        model=model,
        reward_funcs=[counting(job.reward_funcs[0]), *job.reward_funcs[1:]],  # count each completion once
        args=args,
        train_dataset=job.train_dataset,
        processing_class=job.tokenizer,
        callbacks=callbacks,
        optimizers=optimizers,
        rollout_func=meshy_sampler(seed, args.temperature, args.max_completion_length) if meshy_sampling else None,
    )
    trainer.remove_callback(PrinterCallback)  # steps.jsonl has the metrics; keep stdout to progress lines
    if job.check is not None:
        with clock.excluding("checks"):
            job.check(trainer)
    trainer.train()
    steps_file.close()
    total = clock.now()
    lines = [json.loads(line) for line in steps_path.read_text().splitlines()]
    trained = [line for line in lines if "reward_mean" in line]
    startup = trained[0]["time"] if trained else None
    summary = {
        "job": job_name,
        "recipe": str(recipe) if recipe is not None else None,
        "seed": seed,
        "steps": len(trained),
        "startup_s": startup,
        "total_s": total,
        "steps_per_s": (len(trained) - 1) / (trained[-1]["time"] - startup) if len(trained) > 1 else None,
        "target": TARGET,
        "window": WINDOW,
        "steps_to_target": steps_to_target(rewards),
        "last20_mean": sum(rewards[-WINDOW:]) / len(rewards[-WINDOW:]) if rewards else None,
        **eval_summary(lines),
        "excluded_s": clock.excluded,
        "t0_unix": T0_UNIX,
        "threads": threads,
        "meshy_skip": meshy_skip,
        "meshy_sampler": meshy_sampling,
        "skipped_steps": skip.skipped if skip is not None else None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return summary


def _tied_group_pushing_trainer(base, penalty: float, scored: dict, group_size: int):
    """Meshy's algorithm.tied_group_penalty in TRL: after GRPO's advantages, every completion of a group whose
    rewards are all equal and below the best reward of the step gets -penalty (meshy.train.advantages.
    push_tied_groups, Meshy's own function). A TRL step scores its whole batch at once; Meshy's rollout scores
    the rows ready together, at W=1 mostly a whole version."""
    import torch

    from meshy.train.advantages import push_tied_groups

    class TiedGroupPushingTrainer(base):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            rewards = torch.tensor(scored["last"], dtype=torch.float32, device=output["advantages"].device)
            advantages = output["advantages"]
            pushed, _ = push_tied_groups(advantages.view(-1, group_size), rewards.view(-1, group_size), penalty)
            output["advantages"] = pushed.reshape(advantages.shape).to(advantages.dtype)
            return output

    return TiedGroupPushingTrainer


def _skipping_trainer(base, skip: MeshySkip):
    class SkippingTrainer(base):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            reward = self._metrics["train"]["reward"][-1]
            explore = reward < skip.best
            skip.best = max(skip.best, reward)
            skip.skip = not bool((output["advantages"] != 0).any()) and not explore
            skip.skipped += skip.skip
            return output

    return SkippingTrainer


def _skipping_adamw(model, args, skip: MeshySkip):
    import torch

    class SkippingAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            if skip.skip:
                return None
            return super().step(closure)

    return SkippingAdamW(
        model.parameters(),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", choices=("default", "recipe"), default="default")
    parser.add_argument("--recipe", type=Path, help="--job recipe: the recipe file")
    parser.add_argument("--seed", type=int, help="default: the recipe's")
    parser.add_argument("--steps", type=int, help="default: the recipe's")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--meshy-sampler", action="store_true", help="experiment: sample as Meshy's engine does")
    parser.add_argument("--meshy-skip", action="store_true", help="experiment: skip steps as Meshy's trainer does")
    a = parser.parse_args(argv)
    if (a.job == "recipe") != (a.recipe is not None):
        parser.error("--recipe goes with --job recipe, and --job recipe needs it")
    from meshy.recipes.recipe import load_recipe

    recipe = load_recipe(a.recipe)  # None: the embedded default, the default job's
    seed = recipe.seed if a.seed is None else a.seed
    steps = recipe.steps if a.steps is None else a.steps
    run(a.job, seed, steps, a.out, a.threads, a.meshy_skip, a.meshy_sampler, a.recipe)


if __name__ == "__main__":
    sys.exit(main())
