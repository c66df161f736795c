"""meshy.train against plain torch, in one run, on this machine.

    uv run python bench/train_step.py [--steps 20] [--publish-model qwen3-0.6b] [--lora]
    uv run python bench/train_step.py --lora-only [--lora-model smollm2-135m] [--lora-ranks 8 32]
    python bench/train_step.py --device cuda --model qwen3-0.6b --dtype bfloat16 --activation-checkpoint full \\
        --groups 4 --response 1984 --skip-publish

Step time: the training service (lease whole groups from a live data plane, build the batch, one
PPO step with truncated importance sampling, ack) against a plain torch loop doing the same forward,
backward, clipping and AdamW step on the same tokens, single process, on `--device` in `--dtype` (the
model is built by the same `build_model` for both: float32 weights, compute in the dtype). Tokens/s
and MFU: model FLOPs per token 6 x parameters (the tied head counted once, an untied input embedding
not at all: a lookup) + 12 x layers x heads x head_dim x sequence (attention), as torchtitan counts
them, over `--peak-tflops` (H100/H200 dense bfloat16: 989).
LoRA against full fine-tuning (--lora, --lora-only): PolicyTrainer steps on the same batches of
`--lora-model` (default smollm2-135m, 4 rows x 256 tokens), every weight trained against adapters of
`--lora-ranks` on the attention's projections and on every projection; step time (median) and peak
memory, each variant in a fresh process: on the CPU the peak resident memory above what the process held
before building the model (weights, gradients, optimizer state, activations), on CUDA torch's peak
allocated memory.
Publish time: DirectoryPublisher (gather, HF names, bf16, safetensors, checksum, atomic rename)
against a raw `safetensors.torch.save_file` of the same tensors.
"""

import argparse
import multiprocessing
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from meshy.dataplane import HOST, DataPlaneClient, DataPlaneServer, new_secret
from meshy.dataplane import columns as cols
from meshy.train.models import DecoderArch, get_model
from meshy.train.parallel import build_model
from meshy.train.publish import DTYPES, DirectoryPublisher, hf_tensors
from meshy.train.service import TrainingService, TrainServiceConfig
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LoraConfig, LossConfig, OptimConfig, ParallelConfig

LR, CLIP_LOW, CLIP_HIGH, TIS_LOW, TIS_HIGH = 1e-4, 0.2, 0.28, 0.5, 5.0


@dataclass(frozen=True)
class Shape:
    groups: int
    group: int
    prompt: int
    response: int

    @property
    def rows(self) -> int:
        return self.groups * self.group

    @property
    def tokens(self) -> int:
        return self.rows * (self.prompt + self.response)


def rows(step: int, vocab: int, shape: Shape) -> dict:
    g = torch.Generator(HOST).manual_seed(step)
    n, response = shape.rows, shape.response
    return {
        "prompt": torch.randint(0, vocab, (n, shape.prompt), generator=g, device=HOST),
        "response": torch.randint(0, vocab, (n, response), generator=g, device=HOST),
        "rollout_logprobs": -torch.rand(n, response, generator=g, device=HOST) - 5.0,
        "advantage": torch.randn(n, 1, generator=g, device=HOST).expand(n, response).contiguous(),
    }


class PlainLoop:
    """The same math in plain torch: no data plane, no batch building, no metrics."""

    def __init__(self, model: torch.nn.Module, shape: Shape):
        self.model, self.shape = model, shape
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def step(self, data: dict) -> None:
        data = {k: v.to(self.device) for k, v in data.items()}
        tokens = torch.cat([data["prompt"], data["response"]], dim=1)
        logits = self.model(tokens[:, :-1]).float()
        logprobs = torch.gather(F.log_softmax(logits, -1), -1, tokens[:, 1:, None]).squeeze(-1)
        logprobs = logprobs[:, self.shape.prompt - 1 :]
        old = logprobs.detach()
        ratio = torch.exp(logprobs - old)
        adv = data["advantage"]
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
        pg = pg * torch.exp(old - data["rollout_logprobs"]).clamp(TIS_LOW, TIS_HIGH)
        loss = pg.sum() / pg.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss.item()  # the service reads its metrics back every step: so does the loop


class NoPublish:
    def publish(self, model: torch.nn.Module, version: int) -> None:
        return None


def produce(client: DataPlaneClient, step: int, vocab: int, shape: Shape) -> None:
    data, base = rows(step, vocab, shape), step * shape.rows
    ids = list(range(base, base + shape.rows))
    client.put("rollout", ids, {cols.PROMPT_IDS: list(data["prompt"])}, group_ids=[i // shape.group for i in ids])
    columns = {
        cols.RESPONSE_IDS: list(data["response"]),
        cols.ROLLOUT_LOGPROBS: list(data["rollout_logprobs"]),
        cols.TOKEN_VERSIONS: [torch.full((shape.response,), step, device=HOST)] * len(ids),
        cols.ADVANTAGE: list(data["advantage"]),
    }
    client.add_columns("rollout", ids, columns)


def flops_per_token(arch: DecoderArch, sequence: int) -> float:
    params = arch.num_parameters() - (0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size)
    attention = 12 * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim * sequence
    return 6 * params + attention


def step_times(args: argparse.Namespace, arch: DecoderArch, shape: Shape) -> dict[str, list[float]]:
    """Both paths step by step, interleaved, so drift on a shared machine hits both alike."""
    parallel = ParallelConfig(activation_checkpoint=args.activation_checkpoint, compile=args.compile)
    build = {"device": args.device, "dtype": args.dtype, "seed": 0}
    plain = PlainLoop(build_model(arch, parallel, **build)[0], shape)
    model = build_model(arch, parallel, **build)[0]
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else lambda: None
    times: dict[str, list[float]] = {"plain torch loop": [], "meshy training service": []}
    secret = new_secret()
    with DataPlaneServer.start(secret) as server, DataPlaneClient(server.endpoints, secret) as client:
        client.create_table(cols.rollout_table("rollout", group_size=shape.group, tasks=(cols.TRAIN_TASK,)))
        trainer = PolicyTrainer(model, OptimConfig(lr=LR), LossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH))
        service = TrainingService(client, trainer, NoPublish(), TrainServiceConfig(groups_per_rank=shape.groups))
        produce(client, 0, arch.vocab_size, shape)  # rollout runs a batch ahead of training, as in a pipelined run
        for step in range(args.steps + 2):
            produce(client, step + 1, arch.vocab_size, shape)  # not timed
            sync()
            start = time.perf_counter()
            plain.step(rows(step, arch.vocab_size, shape))
            sync()
            times["plain torch loop"].append(time.perf_counter() - start)
            start = time.perf_counter()
            service.train_batch(service.wait_for_batch())
            sync()
            times["meshy training service"].append(time.perf_counter() - start)
        service.close()
    return {name: values[2:] for name, values in times.items()}  # the first steps warm up allocators (and compile)


ATTENTION = ("wq", "wk", "wv", "wo")
EVERY_PROJECTION = (*ATTENTION, "w1", "w2", "w3")


@dataclass(frozen=True)
class Variant:
    name: str
    lora: LoraConfig | None


def lora_variants(ranks: list[int]) -> list[Variant]:
    variants = [Variant("full fine-tuning", None)]
    for targets, what in ((ATTENTION, "attention"), (EVERY_PROJECTION, "all projections")):
        variants += [Variant(f"LoRA r={r}, {what}", LoraConfig(rank=r, alpha=2.0 * r, targets=targets)) for r in ranks]
    return variants


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure_variant(args: argparse.Namespace, variant: Variant) -> dict[str, float]:
    """In a fresh process: a trainer of the variant takes `--lora-steps` steps (after 2 not timed) on the
    same batches as every other variant; its median step time, peak memory and trainable parameters."""
    device, arch = torch.device(args.device), get_model(args.lora_model)
    before = _resident_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    parallel = ParallelConfig(activation_checkpoint=args.activation_checkpoint)
    model, _ = build_model(arch, parallel, device=device, dtype=args.dtype, seed=0, lora=variant.lora)
    trainer = PolicyTrainer(model, OptimConfig(lr=LR), LossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH))
    shape = Shape(1, args.lora_rows, args.prompt, args.lora_tokens - args.prompt)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    times = []
    for step in range(args.lora_steps + 2):
        data = {k: v.to(device) for k, v in rows(step, arch.vocab_size, shape).items()}
        tokens = torch.cat([data["prompt"], data["response"]], dim=1)
        mask = torch.zeros(shape.rows, tokens.shape[1] - 1, device=device)
        mask[:, shape.prompt - 1 :] = 1.0
        rollout = torch.zeros_like(mask)
        rollout[:, shape.prompt - 1 :] = data["rollout_logprobs"]
        batch = PolicyBatch(tokens, mask, data["advantage"][:, 0], rollout_logprobs=rollout)
        sync()
        start = time.perf_counter()
        trainer.step(batch)
        sync()
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:  # ru_maxrss: KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"ms": statistics.median(times[2:]) * 1e3, "peak_mib": peak / 2**20, "trainable": trainable}


def lora_table(args: argparse.Namespace) -> None:
    variants = lora_variants(args.lora_ranks)
    results = {}
    spawn = multiprocessing.get_context("spawn")
    for variant in variants:  # one process each: a peak is the variant's own
        with spawn.Pool(1) as pool:
            results[variant.name] = pool.apply(measure_variant, (args, variant))
    memory = "peak resident memory above the process before the build" if args.device == "cpu" else "peak allocated"
    print(
        f"\nLoRA vs full fine-tuning, {args.lora_model} on {args.device}, {args.dtype} compute, PolicyTrainer steps of "
        f"{args.lora_rows} rows x {args.lora_tokens} tokens, median of {args.lora_steps}; memory: {memory}\n"
    )
    columns = f"| {'variant':<28} | {'trainable params':>16} | {'ms/step':>8} | {'vs full':>7} | {'peak MiB':>8} |"
    print(f"{columns} {'vs full':>7} |")
    print(f"|{'-' * 30}|{'-' * 18}|{'-' * 10}|{'-' * 9}|{'-' * 10}|{'-' * 9}|")
    full = results[variants[0].name]
    for name, r in results.items():
        print(
            f"| {name:<28} | {r['trainable']:>16,} | {r['ms']:>8.1f} | {r['ms'] / full['ms']:>6.2f}x | "
            f"{r['peak_mib']:>8.0f} | {r['peak_mib'] / full['peak_mib']:>6.2f}x |"
        )


def publish_times(model_name: str, dtype: str, reps: int) -> tuple[list[float], list[float]]:
    """Raw save_file of the final tensors (already in `dtype`) against publishing from the model."""
    arch = get_model(model_name)
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=0)
    tensors = dict(hf_tensors(model, arch, DTYPES[dtype]))
    raw, ours = [], []
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        publisher = DirectoryPublisher(Path(tmp) / "weights", arch, dtype=dtype, keep=1)
        for rep in range(reps):
            start = time.perf_counter()
            save_file(tensors, Path(tmp) / f"raw{rep}.safetensors", metadata={"format": "pt"})
            raw.append(time.perf_counter() - start)
            (Path(tmp) / f"raw{rep}.safetensors").unlink()
            start = time.perf_counter()
            publisher.publish(model, rep)
            ours.append(time.perf_counter() - start)
    return raw, ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="qwen3-tiny")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--activation-checkpoint", default="none", choices=["none", "selective", "full"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=448)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense peak in --dtype")
    parser.add_argument("--publish-model", default="qwen3-0.6b")
    parser.add_argument("--publish-reps", type=int, default=5)
    parser.add_argument("--skip-publish", action="store_true")
    parser.add_argument("--lora-model", default="smollm2-135m")
    parser.add_argument("--lora-ranks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--lora-rows", type=int, default=4)
    parser.add_argument("--lora-tokens", type=int, default=256, help="tokens per row, prompt (--prompt) included")
    parser.add_argument("--lora-steps", type=int, default=5)
    parser.add_argument("--lora", action="store_true", help="the LoRA vs full fine-tuning table too, first")
    parser.add_argument("--lora-only", action="store_true", help="the LoRA vs full fine-tuning table alone")
    args = parser.parse_args()
    if args.lora or args.lora_only:
        lora_table(args)
    if args.lora_only:
        return
    arch, shape = get_model(args.model), Shape(args.groups, args.group, args.prompt, args.response)
    results = {name: statistics.median(values) for name, values in step_times(args, arch, shape).items()}
    flops = flops_per_token(arch, shape.prompt + shape.response)
    print(
        f"\nstep time, {args.model} on {args.device}, {args.dtype} compute, activation checkpointing "
        f"{args.activation_checkpoint}{', compiled' if args.compile else ''}, {shape.rows} rows x "
        f"{shape.prompt + shape.response} tokens, median of {args.steps}\n"
    )
    print(f"| {'path':<24} | {'ms/step':>8} | {'tokens/s':>9} | {'MFU':>6} |")
    print(f"|{'-' * 26}|{'-' * 10}|{'-' * 11}|{'-' * 8}|")
    for name, median in results.items():
        rate = shape.tokens / median
        mfu = rate * flops / (args.peak_tflops * 1e12)
        print(f"| {name:<24} | {median * 1e3:>8.1f} | {rate:>9.0f} | {mfu:>6.1%} |")
    plain, service = results.values()
    print(f"\nservice / plain loop: {service / plain:.3f}x (target <= 1.10x)")
    if args.skip_publish:
        return
    print(f"\npublish, median of {args.publish_reps}; the model trains in float32 here\n")
    print(f"| {'model':<12} | {'published as':<12} | {'raw save_file s':>15} | {'publisher s':>11} | {'ratio':>6} |")
    print(f"|{'-' * 14}|{'-' * 14}|{'-' * 17}|{'-' * 13}|{'-' * 8}|")
    for model_name, dtype in (
        ("qwen3-tiny", "float32"),
        (args.publish_model, "float32"),
        (args.publish_model, "bfloat16"),
    ):
        raw, ours = publish_times(model_name, dtype, args.publish_reps)
        r, o = statistics.median(raw), statistics.median(ours)
        print(f"| {model_name:<12} | {dtype:<12} | {r:>15.3f} | {o:>11.3f} | {o / r:>5.2f}x |")
    print(
        "\ntarget <= 1.3x for the same tensors (float32 rows). Publishing bfloat16 from float32 weights also"
        "\nconverts every tensor on the CPU (a GPU trainer converts on the device); the tiny model's times"
        "\nare directory, config and rename costs of a few milliseconds."
    )


if __name__ == "__main__":
    main()
