"""TorchEngine against Hugging Face `transformers` generate, in one run, on this machine.

    uv run python bench/generate.py [--requests 64] [--batch 16] [--prompt 32] [--response 128] [--compile]
    python bench/generate.py --device cuda --dtype bfloat16 --models qwen3-0.6b --requests 256 --batch 128

Both load the same published HF directory (random weights in `--dtype`, EOS disabled so every request
runs to its own budget) and sample with temperature 1, no top-k/top-p, on `--device`. Each model gets
`--requests` prompts with at most `--batch` generating at once: HF `generate` takes them in static batches of `--batch`
(left-padded), TorchEngine takes them all and keeps `--batch` running (continuous batching). With
`--compile` a second TorchEngine whose forward and sampler go through torch.compile runs beside the first
(its compilation happens in the warm-up, not timed).

- equal: every prompt `--prompt` tokens, every response `--response` tokens.
- mixed: prompt lengths spread over [prompt/4, prompt], response budgets over [response/8, response].
  A static batch decodes until its longest member is done (what a batch does when its members hit EOS
  at different steps); the engine frees a finished request's slot and admits the next at once.

Tokens/s counts the tokens the requests asked for (the same for both), over wall time after a warm-up;
the two sides run alternately `--repeats` times and each reports its median. On equal lengths every
step decodes a full batch, so the engine's time per decode step is its time over the steps it ran; it
is set against the memory-bandwidth bound of that step (the weights plus the keys and values of a
batch at the mean context, read once, at `--bandwidth` TB/s).
"""

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from meshy.dataplane.model_source import read_model
from meshy.infer import sampling
from meshy.infer.engine import SamplingParams
from meshy.infer.torch_engine import TorchEngine, decode_shape
from meshy.infer.torch_model import KVCache, ModelConfig, load_model
from meshy.train.models import DecoderArch, get_model
from meshy.train.parallel import build_model
from meshy.train.publish import DirectoryPublisher
from meshy.train.training_config import ParallelConfig

MODELS = {
    "qwen3-tiny": get_model("qwen3-tiny"),
    "llama-135m": get_model("smollm2-135m"),  # SmolLM2-135M's shape
    "qwen3-0.6b": get_model("qwen3-0.6b"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ENGINES = ("TorchEngine", "compiled")  # the eager engine, and with --compile the compiled one


def publish(arch: DecoderArch, root: Path, args: argparse.Namespace) -> Path:
    model, _ = build_model(arch, ParallelConfig(), device=args.device, seed=0)
    directory = Path(DirectoryPublisher(root, arch, dtype=args.dtype).publish(model, 0).location)
    del model
    config = json.loads((directory / "config.json").read_text())
    config["eos_token_id"] = None  # every request runs to its own budget in both engines
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def workload(kind: str, args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    out = []
    for _ in range(args.requests):
        if kind == "equal":
            prompt, response = args.prompt, args.response
        else:
            prompt = rng.randint(args.prompt // 4, args.prompt)
            response = rng.randint(args.response // 8, args.response)
        out.append(([rng.randrange(3, vocab) for _ in range(prompt)], response))
    return out


def run_hf(model: torch.nn.Module, requests: list[tuple[list[int], int]], batch: int) -> None:
    device = model.device
    for start in range(0, len(requests), batch):
        chunk = requests[start : start + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
        budget = max(n for _, n in chunk)
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=budget,
                min_new_tokens=budget,
                pad_token_id=0,
            )
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def run_engine(engine: TorchEngine, requests: list[tuple[list[int], int]]) -> None:
    calls = [
        engine.generate(f"r{i}", prompt, SamplingParams(max_new_tokens=n, seed=i))
        for i, (prompt, n) in enumerate(requests)
    ]
    outputs = await asyncio.gather(*calls)
    assert [len(o.output_ids) for o in outputs] == [n for _, n in requests]


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_bound_s(arch: DecoderArch, args: argparse.Namespace) -> float:
    """Seconds one full decode step needs at least: every weight and, for each request, the keys and
    values of its mean context read once from memory at --bandwidth TB/s."""
    config = arch.hf_config(args.dtype)
    width = DTYPES[args.dtype].itemsize
    params = arch.num_parameters()
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * width
    context = args.prompt + args.response / 2
    return (params * width + args.batch * context * kv_per_token) / (args.bandwidth * 1e12)


def full_batch_rows(n: int, vocab: int, device: torch.device) -> sampling.Rows:
    """Sampling rows of n requests at temperature 1, untruncated (what the bench's requests ask)."""
    return sampling.Rows(
        temperature=torch.ones(n, device=device),
        top_k=torch.full((n,), vocab, device=device),
        top_p=torch.ones(n, device=device),
        seed=torch.arange(n, device=device),
        counter=torch.zeros(n, dtype=torch.int64, device=device),
        truncated=False,
    )


def sampler_ms(arch: DecoderArch, args: argparse.Namespace, reps: int = 20) -> float:
    """Milliseconds the sampler takes for a full batch (logits in, tokens read back), alone."""
    device, n = torch.device(args.device), args.batch
    logits = torch.randn(n, arch.vocab_size, device=device, generator=torch.Generator(device).manual_seed(0))
    rows = full_batch_rows(n, arch.vocab_size, device)
    sampling.sample(logits, rows)[0].tolist()
    start = time.perf_counter()
    for _ in range(reps):
        tokens, logprobs = sampling.sample(logits, rows)
        torch.stack([tokens.double(), logprobs.double()]).tolist()
    return (time.perf_counter() - start) / reps * 1e3


_NOT_COMPUTING = ("empty.memory_format", "empty_strided.default", "_unsafe_view.default")


class _CountOperators(TorchDispatchMode):
    """Counts the operators that compute (not views, reshapes of fresh results or bare allocations):
    each a kernel launch when it runs eagerly on a GPU. Composite operators count as what they run as on
    this device (on a CPU, RMSNorm is seven; a GPU may have one fused kernel for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.__name__ not in _NOT_COMPUTING:
            self.count += 1
        return func(*args, **(kwargs or {}))


def decode_operators(directory: Path, args: argparse.Namespace) -> tuple[int, int]:
    """Operators one eager decode step of a full batch dispatches: (forward and logits, sampler)."""
    config, tensors = read_model(directory)
    model_config = ModelConfig.from_hf(config)
    device = torch.device(args.device)
    model = load_model(model_config, tensors, device, DTYPES[args.dtype])
    max_len = args.prompt + args.response
    cache = KVCache(model_config, args.batch, max_len, device, DTYPES[args.dtype])
    batch, span = decode_shape(range(args.batch), [args.prompt] * args.batch, args.batch, max_len)
    positions = torch.full((batch,), args.prompt, dtype=torch.int64, device=device)
    tokens = torch.zeros(batch, dtype=torch.int64, device=device)
    rows = full_batch_rows(batch, model_config.vocab_size, device)
    with torch.no_grad(), _CountOperators() as forward:
        logits = model.logits(model.decode(tokens, positions, cache, span)[0])
    with torch.no_grad(), _CountOperators() as sampler:
        sampling.sample(logits, rows)
    return forward.count, sampler.count


def profile(fn: Callable[[], object], device: str) -> None:
    """Run `fn` under torch.profiler and print its costliest ops (on the device, then on the host)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device != "cpu":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:  # the engine's ops run in its worker thread
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # an older torch: the host ops of the worker thread are not listed
        config = None
    with torch.profiler.profile(activities=activities, experimental_config=config) as prof:
        fn()
    averages = prof.key_averages()
    keys = (["self_device_time_total"] if device != "cpu" else []) + ["self_cpu_time_total"]
    for key in keys:
        print(averages.table(sort_by=key, row_limit=12, max_name_column_width=60), flush=True)


def print_header(args: argparse.Namespace) -> None:
    where = f"{torch.get_num_threads()} threads" if args.device == "cpu" else torch.cuda.get_device_name(args.device)
    print(
        f"\nTorchEngine vs HF generate: {args.requests} requests, batch {args.batch}, prompt <= {args.prompt}, "
        f"response <= {args.response}, {args.dtype}, {args.device} ({where}), "
        f"median of {args.repeats} alternated runs per side\n"
    )
    sides = ENGINES if args.compile else ENGINES[:1]
    head = "".join(f" {side} tok/s | speedup | decode step |" for side in sides)
    print(f"| model | lengths | tokens | HF tok/s |{head} bound |")
    print("|---|---|---|---|" + "---|---|---|" * len(sides) + "---|", flush=True)


def print_row(name: str, kind: str, tokens: int, hf_rate: float, *engines: float | None, bound: float | None) -> None:
    """One table row, printed as soon as it is measured (a run cut short still reports what it did)."""
    cells = ""
    for rate, speedup, step in zip(engines[::3], engines[1::3], engines[2::3], strict=True):
        cells += f" {rate:.0f} | {speedup:.2f}x | {f'{step * 1e3:.2f} ms' if step is not None else '-'} |"
    bound_text = f"{bound * 1e3:.2f} ms" if bound is not None else "-"
    print(f"| {name} | {kind} | {tokens} | {hf_rate:.0f} |{cells} {bound_text} |", flush=True)


def compare(name: str, directory: Path, args: argparse.Namespace) -> None:
    """Print a row per workload: model, lengths, tokens, HF tok/s, and for each engine its tok/s, its
    speedup over HF and its time per decode step on equal lengths."""
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[args.dtype]).to(args.device).eval()
    hf.generation_config.eos_token_id = None
    engines = [
        TorchEngine(
            directory,
            max_running=args.batch,
            max_len=args.prompt + args.response,
            device=args.device,
            dtype=args.dtype,
            compile=compiled,
        )
        for compiled in ([False, True] if args.compile else [False])
    ]
    loop = asyncio.new_event_loop()

    def on_engine(engine: TorchEngine, requests: list[tuple[list[int], int]]) -> None:
        loop.run_until_complete(run_engine(engine, requests))

    try:
        for kind in ("equal", "mixed"):
            requests = workload(kind, args, hf.config.vocab_size)
            tokens = sum(n for _, n in requests)
            run_hf(hf, requests[: args.batch], args.batch)  # warm-up: allocations, first-call dispatch
            for engine in engines:  # and compilation and graph capture: every shape the workload runs
                on_engine(engine, requests)
            hf_s, engine_s = [], [[] for _ in engines]
            for _ in range(args.repeats):  # alternated, so all see the machine in the same state
                hf_s.append(seconds(partial(run_hf, hf, requests, args.batch)))
                for engine, times in zip(engines, engine_s, strict=True):
                    times.append(seconds(partial(on_engine, engine, requests)))
            hf_median = statistics.median(hf_s)
            steps = -(-len(requests) // args.batch) * args.response  # full-batch decode steps (equal lengths)
            row = [name, kind, tokens, tokens / hf_median]
            for times in engine_s:
                median = statistics.median(times)
                row += [tokens / median, hf_median / median, median / steps if kind == "equal" else None]
            print_row(*row, bound=step_bound_s(MODELS[name], args) if kind == "equal" else None)
            if args.profile and kind == "mixed":  # where the engine's lead is smallest
                for engine, label in zip(engines, ENGINES, strict=False):
                    print(f"{name} {kind}, {label}: the ops that took the most time", flush=True)
                    profile(partial(on_engine, engine, requests), args.device)
        for engine in engines:
            if args.device != "cpu":
                print(f"{name}: decode CUDA graphs {engine.cuda_graphs}", flush=True)
        print(f"{name}: sampling a batch of {args.batch} takes {sampler_ms(MODELS[name], args):.2f} ms", flush=True)
        forward, sampler = decode_operators(directory, args)
        print(
            f"{name}: an eager decode step of a batch of {args.batch} dispatches {forward} operators in the forward "
            f"and {sampler} in the sampler (kernels, on a GPU without a graph)",
            flush=True,
        )
    finally:
        for engine in engines:
            loop.run_until_complete(engine.close())
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (median reported)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--bandwidth", type=float, default=4.8, help="device memory bandwidth, TB/s (H200: 4.8)")
    parser.add_argument("--compile", action="store_true", help="also a TorchEngine with compile=True")
    parser.add_argument("--profile", action="store_true", help="also profile each engine on mixed lengths")
    args = parser.parse_args()
    print_header(args)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            compare(name, publish(MODELS[name], Path(tmp) / name, args), args)


if __name__ == "__main__":
    main()
