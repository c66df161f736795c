"""The GPU check: what a short lease of one GPU should establish, in one script, within a time budget.

    python3 bench/gpu_check.py --out DIR                      # on one CUDA GPU (see shared/gpu-kit)
    uv run python bench/gpu_check.py --cpu --out DIR          # the same stages on the CPU, tiny (CI)

Stages, in order, each a subprocess with its own timeout (cut to what is left of --budget; a stage that
fails or runs out of time is reported and the next one runs):
  imports           the four packages import; torch, CUDA, the device
  gpu-tests         `pytest -m gpu`: parity per dtype, memory returned by release/offload, conformance
  generate          bench/generate.py: TorchEngine vs transformers `generate`, decode step vs bound, and
                    (on a GPU) where the time of mixed lengths goes (torch.profiler's costliest ops)
  async-speedup     bench/async_speedup.py: W=1 vs W=none with training and inference sharing the GPU
  train-step        bench/train_step.py: tokens/s and MFU of qwen3-0.6b, bfloat16: full activation
                    checkpointing, then selective checkpointing compiled
  generate-compiled the generate stage again with a compiled TorchEngine beside the eager one (after the
                    figures above: compiling at 0.6B size takes minutes on a fresh host)
  default-colocated the default recipe, training and inference colocated on the GPU (token ring)
  ring-0.6b         a qwen3-0.6b-shaped run through the ring: bfloat16, activation checkpointing,
                    release/onload at a real size (what each process still holds after releasing, and
                    what the GPU had free as each got the token: its build's grant included)
  routing-replay    bench/routing_replay.py: the importance ratio's spread with and without routing replay,
                    bfloat16, on a 32-expert tiny MoE and on a 4-layer qwen3-30b-a3b (128 experts, top 8)
  weight-sync       bench/weight_sync.py: qwen3-0.6b from a trainer on the GPU to a TorchEngine on the
                    same GPU over disk, shared memory and the collective (gloo through host buffers)
  ring-ppo          the default recipe as PPO with KL to a reference, training, inference, critic and
                    reference in one GPU ring: each member's turns, none overlapping, memory after release
  lora              LoRA against the whole model: bench/weight_sync.py's adapter versions (rank 8, 32, 64)
                    on qwen3-0.6b, and bench/train_step.py's step time and memory, LoRA vs full
After every stage DIR holds summary.md and summary.json (figures and the tables the benches printed)
and stages.log (every stage's whole output), so a check cut short still reports what it did.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = ROOT / "packages/meshy-recipes/src/meshy/recipes/default.toml"
MESHY = [sys.executable, "-m", "meshy.recipes.cli"]


@dataclass
class Stage:
    name: str
    timeout_s: float
    command: Callable[[Path], list[list[str]]]  # the commands to run, given a scratch directory
    figures: Callable[[Path, str], dict] = lambda scratch, output: {}


@dataclass
class Result:
    name: str
    ok: bool
    seconds: float
    status: str
    figures: dict = field(default_factory=dict)
    tables: list[str] = field(default_factory=list)


RING = ("training", "inference")
PPO_RING = ("training", "inference", "critic", "reference")  # PPO with KL to the reference policy


def recipe(
    scratch: Path, *, steps: int, model: str | None, dtype: str, checkpointing: bool, gpu: bool, ring=RING
) -> Path:
    """The default recipe with the roles of `ring` colocated (on GPU 0 when `gpu`), in `scratch`; a ring
    with the critic and the reference makes it PPO with KL to the reference."""
    text = DEFAULT_RECIPE.read_text()
    if ring == PPO_RING:
        text = text.replace('kind = "grpo"', 'kind = "ppo"').replace(
            "[algorithm.loss]\n", "[algorithm.loss]\nkl_coef = 0.1\n"
        )
        text += "\n[roles.critic]\nprocesses = 1\n\n[roles.reference]\nprocesses = 1\n"
    for key, value in (("steps", steps), ("run_dir", f'"{scratch / "runs"}"'), ("checkpoint_every", 0)):
        text = re.sub(rf"^{key} = .*$", f"{key} = {value}", text, count=1, flags=re.M)
    if model is not None:  # its full vocabulary: the task's 17 ids are the first of them
        text = text.replace('name = "qwen3-tiny"\noverrides = { vocab_size = 17 }', f'name = "{model}"')
    text = text.replace("[model]\n", f'[model]\ndtype = "{dtype}"\n')
    if checkpointing:
        text += '\n[algorithm.parallel]\nactivation_checkpoint = "full"\n'
    text = f"colocate = [{list(ring)}]\n".replace("'", '"') + text
    if gpu:
        for role in ring:
            text = text.replace(
                f"[roles.{role}]\nprocesses = 1", f"[roles.{role}]\nprocesses = 1\ndevices_per_process = 1"
            )
    path = scratch / "recipe.toml"
    path.write_text(text)
    return path


def run_figures(scratch: Path, output: str) -> dict:
    """Versions, time per version, rewards, what the ring's processes held after releasing, and what the
    GPU had free as each got it."""
    (run_dir,) = (scratch / "runs").iterdir()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times, rewards = [m["time"] for m in metrics], [m["reward_mean"] for m in metrics]
    figures = {
        "versions": len(metrics),
        "versions_in_order": [m["version"] for m in metrics] == list(range(1, len(metrics) + 1)),
        "s_per_version": (times[-1] - times[0]) / max(len(times) - 1, 1),
        "reward_first10": sum(rewards[:10]) / len(rewards[:10]),
        "reward_last10": sum(rewards[-10:]) / len(rewards[-10:]),
        "audit_clean": re.search(r"(gaps|duplicates|reordered) \[[^\]]|overlapping [1-9]", output) is None,
    }
    turns = re.search(r"turns (\d+), overlapping (\d+)", output)
    if turns:
        figures["device_turns"], figures["device_turns_overlapping"] = int(turns[1]), int(turns[2])
    for name, least in re.findall(r"^(\S+): got its GPU \d+ times, finding at least ([\d.]+) GiB free$", output, re.M):
        figures[f"{name}_least_free_at_grant_GiB"] = float(least)  # its build's grant included
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        name = path.stem
        released = [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "released"]
        if released:
            figures[f"{name}_max_reserved_after_release_MiB"] = max(r["reserved"] for r in released) / 2**20
            figures[f"{name}_releases"] = len(released)
    return figures


def pytest_figures(scratch: Path, output: str) -> dict:
    counts = dict((word, int(n)) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", output))
    return counts


def stages(args: argparse.Namespace) -> list[Stage]:
    cpu = args.cpu
    gpu = not cpu
    device = "cpu" if cpu else "cuda"

    def run_recipe(steps: int, model: str | None, dtype: str, checkpointing: bool, ring=RING):
        def command(scratch: Path) -> list[list[str]]:
            path = recipe(
                scratch, steps=steps, model=model, dtype=dtype, checkpointing=checkpointing, gpu=gpu, ring=ring
            )
            run_root = scratch / "runs"
            return [[*MESHY, "run", str(path)], ["sh", "-c", f'{" ".join(MESHY)} inspect "$(ls -d {run_root}/*)"']]

        return command

    imports = (
        "import platform, torch, meshy.dataplane, meshy.train, meshy.infer, meshy.recipes;"
        "print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda,"
        " torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
    )
    generate = ["--models", "qwen3-tiny", "--requests", "8", "--batch", "4", "--response", "8", "--repeats", "1"]
    if gpu:
        generate = ["--models", "qwen3-0.6b", "--requests", "256", "--batch", "128", "--prompt", "32"]
        generate += ["--response", "128", "--repeats", "2"]
    train = ["--skip-publish", "--model", "qwen3-tiny", "--groups", "1", "--response", "32", "--steps", "2"]
    if gpu:
        train = ["--skip-publish", "--model", "qwen3-0.6b", "--groups", "4", "--prompt", "64", "--response", "960"]
        train += ["--steps", "5"]
    # Full checkpointing as measured before, then what may reach the MFU target: selective and compiled.
    train_variants = [["--activation-checkpoint", "full"], ["--activation-checkpoint", "selective", "--compile"]]
    if cpu:
        train_variants = train_variants[:1]  # compiling the tiny trainer takes longer than the stage's budget
    asynchronous = ["--modes", "W=1", "W=none", "--steps", "2", "--max-new-tokens", "8", "--prompts-per-step", "4"]
    if gpu:
        # 8 versions x 256 tokens did not finish in 156 s on an H200; this size took 123 s there
        asynchronous = ["--gpu", "--modes", "W=1", "W=none", "--steps", "4", "--max-new-tokens", "128"]
    replay = [["--experts", "32", "--top-k", "4", "--prompts", "8", "--response", "8"]]
    if gpu:
        replay = [["--experts", "32", "--top-k", "4"], ["--model", "qwen3-30b-a3b", "--layers", "4", "--sharpen", "1"]]
    weights = ["--models", "qwen3-tiny", "--versions", "1", "--transports", "disk", "shared-memory", "collective"]
    if gpu:
        weights = ["--device", "cuda", "--models", "qwen3-0.6b", "--versions", "2"]
        weights += ["--transports", "disk", "shared-memory", "collective"]
    lora_sync = ["--no-full", "--models", "qwen3-tiny", "--versions", "1", "--lora-ranks", "8", "32"]
    lora_step = ["--lora-only", "--lora-model", "qwen3-tiny", "--lora-steps", "2", "--lora-ranks", "8"]
    if gpu:
        lora_sync = ["--no-full", "--device", "cuda", "--models", "qwen3-0.6b", "--versions", "2"]
        lora_step = ["--lora-only", "--lora-model", "qwen3-0.6b", "--lora-rows", "8", "--lora-tokens", "1024"]
    weights += ["--lora-ranks"]  # the whole model only: adapter versions are the lora stage's
    checkpoints = ["--trainer", "--model", "qwen3-tiny", "--rows", "2", "--tokens", "32", "--steps", "2"]
    if gpu:
        checkpoints = ["--trainer", "--device", "cuda", "--model", "qwen3-0.6b", "--dtype", "bfloat16"]
        checkpoints += ["--rows", "4", "--tokens", "1024", "--steps", "5"]
    bench = [sys.executable, str(ROOT / "bench")]
    profile = ["--profile"] if gpu else []

    def run_generate(*extra: str) -> Callable[[Path], list[list[str]]]:
        command = [bench[0], f"{bench[1]}/generate.py", "--device", device, "--dtype", "bfloat16", *generate, *extra]
        return lambda scratch: [command]

    # the gpu tests are mostly host-bound: several at once on a GPU host
    gpu_tests = [*(["-n", "4"] if gpu else []), str(ROOT / "tests")]
    return [
        Stage("imports", 60, lambda scratch: [[sys.executable, "-c", imports]]),
        Stage(
            "gpu-tests",
            150,
            lambda scratch: [[sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *gpu_tests]],
            pytest_figures,
        ),
        Stage("generate", 300, run_generate(*profile)),
        Stage("async-speedup", 180, lambda scratch: [[bench[0], f"{bench[1]}/async_speedup.py", *asynchronous]]),
        Stage(
            "train-step",
            240,
            lambda scratch: [
                [bench[0], f"{bench[1]}/train_step.py", "--device", device, "--dtype", "bfloat16", *train, *variant]
                for variant in train_variants
            ],
        ),
        Stage("generate-compiled", 300, run_generate("--compile")),
        Stage(
            "default-colocated", 120, run_recipe(2 if cpu else 40, None, "float32", checkpointing=False), run_figures
        ),
        Stage(
            "ring-0.6b",
            150,
            run_recipe(1 if cpu else 4, None if cpu else "qwen3-0.6b", "bfloat16", checkpointing=True),
            run_figures,
        ),
        Stage(
            "routing-replay",
            180,
            lambda scratch: [
                [bench[0], f"{bench[1]}/routing_replay.py", "--device", device, "--dtype", "bfloat16", *shape]
                for shape in replay
            ],
        ),
        Stage("weight-sync", 120, lambda scratch: [[bench[0], f"{bench[1]}/weight_sync.py", *weights]]),
        Stage(
            "ring-ppo",
            120,
            run_recipe(2 if cpu else 10, None, "float32", checkpointing=False, ring=PPO_RING),
            run_figures,
        ),
        Stage(
            "checkpoint",
            240,
            lambda scratch: [[bench[0], f"{bench[1]}/checkpoint_cost.py", "--repeats", "1", *checkpoints]],
        ),
        Stage(
            "lora",
            240,
            lambda scratch: [
                [bench[0], f"{bench[1]}/weight_sync.py", *lora_sync],
                [bench[0], f"{bench[1]}/train_step.py", "--device", device, "--dtype", "bfloat16", *lora_step],
            ],
        ),
    ]


def run_stage(stage: Stage, timeout: float, log) -> Result:
    start = time.monotonic()
    output, status, ok = "", "ok", True
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        try:
            for command in stage.command(scratch):
                left = timeout - (time.monotonic() - start)
                code, text = run(command, left)
                output += f"$ {' '.join(command)}\n{text}\n"
                if code is None:
                    status, ok = f"timed out after {timeout:.0f} s", False
                    break
                if code != 0:
                    status, ok = f"exit code {code}", False
                    break
            figures = stage.figures(scratch, output) if ok else {}
        except Exception as e:  # a stage's own failure is its result; the next stage still runs
            status, ok, figures = f"{type(e).__name__}: {e}", False, {}
    log.write(f"\n===== {stage.name}: {status}\n{output}")
    log.flush()
    tables = [line for line in output.splitlines() if line.startswith("|")]
    return Result(stage.name, ok, time.monotonic() - start, status, figures, tables)


def run(command: list[str], timeout: float) -> tuple[int | None, str]:
    """Exit code (None: killed at the timeout, with everything it started) and the output."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=ROOT
    )
    try:
        out, _ = process.communicate(timeout=max(timeout, 1))
        return process.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        return None, out


def write_summary(out: Path, results: list[Result], args: argparse.Namespace) -> None:
    (out / "summary.json").write_text(json.dumps([vars(r) for r in results], indent=1))
    lines = [f"# GPU check ({'cpu' if args.cpu else 'gpu'}, budget {args.budget:.0f} s)", ""]
    lines += ["| stage | ok | seconds | status |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {'yes' if r.ok else 'NO'} | {r.seconds:.0f} | {r.status} |" for r in results]
    for r in results:
        if r.figures or r.tables:
            lines += ["", f"## {r.name}", ""]
            lines += [
                f"- {key}: {value:.4g}" if isinstance(value, float) else f"- {key}: {value}"
                for key, value in r.figures.items()
            ]
            lines += r.tables
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def chosen(every: list[Stage], names: list[str] | None) -> list[Stage]:
    """The stages named, in the order named (every stage, in order, when none is)."""
    if not names:
        return every
    by_name = {stage.name: stage for stage in every}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise SystemExit(f"--stages: unknown {unknown}; expected some of {list(by_name)}")
    return [by_name[name] for name in names]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="the same stages on the CPU with tiny sizes")
    parser.add_argument("--budget", type=float, default=360.0, help="seconds for every stage together")
    parser.add_argument("--stages", nargs="+", help="run only these stages, in this order")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    results: list[Result] = []
    with open(args.out / "stages.log", "w") as log:
        for stage in chosen(stages(args), args.stages):
            left = deadline - time.monotonic()
            if left < 10:
                results.append(Result(stage.name, False, 0.0, "skipped: the budget was spent"))
            else:
                results.append(run_stage(stage, min(stage.timeout_s, left), log))
            print(f"{results[-1].name}: {results[-1].status} ({results[-1].seconds:.0f} s)", flush=True)
            write_summary(args.out, results, args)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
