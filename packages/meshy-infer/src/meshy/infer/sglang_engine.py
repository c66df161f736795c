"""SGLangEngine: the Engine interface on an in-process SGLang 0.5.23 engine (the production engine).

SGLang runs its scheduler and detokenizer as child processes and its TokenizerManager in this process,
as coroutines bound to the event loop they first run on. So every call into SGLang runs on one event loop
of our own, on a thread of its own (`_LoopThread`): the public coroutines post there and await the result,
callers may use any loop (or a fresh one per call), and the caller's loop never runs SGLang's work.

Each `generate` is an SGLang request with a rid of its own, streamed back every `stream_interval` tokens
(so a request aborted while SGLang holds it in its queue still returns what it produced; SGLang keeps
no other copy in this process). Its output carries the logprob of every sampled token (temperature
applied, before top-k/top-p truncation, as the trainer computes it) and the spans of weight versions
SGLang records, expanded here to one version per token.

An engine starts from a published version, an HF directory, or (config, tensors) in memory: SGLang then
starts from config.json alone with dummy weights, and the tensors go in as a weight update before the
constructor returns.

Versions broadcast on the weight-sync group (`publish = "collective"`) reach SGLang's schedulers
directly: an engine given `weight_sync_rank` joins the group through SGLang's own weights update group,
where the publisher's announcement says (gloo, on CPU and GPU hosts alike), and Meshy's SGLang plugin
(meshy.infer.sglang_plugin) receives each version inside the schedulers and verifies its checksum before
SGLang loads any of it. Such an engine starts from the first broadcast version's announcement.

Pause, weight updates and release all hold generation the same way, with SGLang's pause_generation: in
"retract" mode running requests go back to SGLang's queue and their KV cache is recomputed when
generation continues (so every token after a weight update comes from the new weights); in "abort" mode
they end and are resubmitted here, their output so far appended to the prompt, once generation
continues. Requests that arrive while generation is held wait.

LoRA versions (meshy.dataplane.adapters) go through SGLang's own LoRA support. An engine started from a
LoRA version on disk starts SGLang from its base's directory with LoRA enabled at the adapter's rank and
target modules (SGLang fixes both at start), and loads each version's adapter, verified, under the name
"v{version}" (SGLang keeps no weights version per adapter). Every new SGLang request names the newest
adapter, and a running SGLang request cannot change adapter: at each version, requests running on an older
adapter are aborted and continue from their output so far under the new one, whatever `pause_mode` says,
so every token's version is the adapter's it was sampled with. The adapter loads while generation goes on
(SGLang applies two adapters per batch here: the new one, and the old one while its requests end), and a
version's adapter is unloaded once no request names it. A version that carries another base loads it
with generation held, as a whole version does; an adapter-only version on a base the engine does not hold
raises CorruptWeights (a version with the base fixes it). A whole model's version, an adapter of a higher
rank or on other modules than the engine started with, or a LoRA version for an engine started from a
whole model raise SchemaError. LoRA versions broadcast on the weight-sync group are refused (the plugin
hands SGLang the model's weights, not its adapters).

What SGLang cannot do here, and what happens instead:
- Seeds: SGLang honours a seed only with enable_deterministic_inference (`deterministic=True`), which
  needs a GPU attention backend (fa3, fa4, flashinfer, triton) and samples with a Triton kernel. Without
  it a request's seed is ignored, and a warning says so once.
- release/onload on CPU: SGLang's release_memory_occupation calls torch.cuda.synchronize and kills the
  scheduler, so on CPU `release` holds generation and scoring until `onload` and frees nothing. On a GPU
  it needs `colocate=True` (SGLang's memory saver, with a host copy of the weights), and weights cannot
  be updated while released.
- Routing of a mixture (`record_routing=True`, for routing replay): SGLang reports the experts of a
  request's positions only when it finishes, for the forward that last computed each position's KV. In
  "retract" mode a paused request's positions are computed again under the new weights, so the routing
  of tokens sampled before an update would be the new weights'. Recording therefore needs "abort" mode:
  each attempt reports the routing of the tokens it produced, and attempts are spliced here.
- `score` waits while generation is held (SGLang gates every request on its pause), not only while
  released.
- A crashed SGLang child process ends this process too (SGLang's SIGQUIT handling). Importing and
  starting SGLang also sets process-wide state: uvloop as the asyncio loop policy, "spawn" as the
  multiprocessing start method, a SIGQUIT handler and some environment variables.
"""

import asyncio
import atexit
import base64
import collections
import contextlib
import json
import logging
import multiprocessing
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from meshy.dataplane import HOST, SchemaError, WeightSyncError
from meshy.dataplane.adapters import Adapter, split_version
from meshy.dataplane.hf_directory import HFDirectory, check_tensor_shapes
from meshy.dataplane.model_source import ModelSource, read_model
from meshy.dataplane.weights import (
    BucketLayout,
    CorruptWeights,
    Published,
    Transport,
    read_published,
    verify_published,
)
from meshy.infer.engine import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    EngineClosed,
    Generation,
    SamplingParams,
    Scores,
    WeightsSource,
)
from meshy.infer.routing_log import EXPERT_ID_DTYPE
from meshy.infer.sglang_plugin import NOT_VERIFIED, check_loaded, receive_request

log = logging.getLogger(__name__)

PAUSE_MODES = ("retract", "abort")
_FINISH_REASONS = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}
# config.json keys that may differ between versions of one model.
_CONFIG_KEYS_NOT_COMPARED = frozenset({"torch_dtype", "dtype", "transformers_version", "_name_or_path"})
_CLOSE_TIMEOUT_S = 60.0
# SGLang caps a request at context_length - 2 tokens and a prompt at context_length - 6: started with this
# much more than max_len, every prompt + output of up to max_len tokens fits and max_len is the only limit.
_CONTEXT_SLACK = 6
# sglang.Engine arguments SGLangEngine sets itself, and the parameter that sets each.
_SET_BY = {
    "model_path": "source",
    "context_length": "max_len",
    "max_running_requests": "max_running",
    "weight_version": "version",
    "random_seed": "seed",
    "enable_deterministic_inference": "deterministic",
    "enable_memory_saver": "colocate",
    "enable_weights_cpu_backup": "colocate",
    "enable_return_routed_experts": "record_routing",
    "skip_tokenizer_init": "nothing: requests are token ids",
    "enable_lora": "source: a LoRA version",
    "max_lora_rank": "source: a LoRA version's adapter rank",
    "lora_target_modules": "source: a LoRA version's adapter target_modules",
    "lora_paths": "update_weights: each LoRA version's adapter is loaded by name",
}
# Adapters SGLang may apply in one batch: the current version's, and the one before while its requests end.
_LORA_PER_BATCH = 2


class SGLangError(RuntimeError):
    """SGLang refused or failed an operation; its own message is included."""


def _model_identity(config: Mapping) -> dict:
    return {k: v for k, v in config.items() if k not in _CONFIG_KEYS_NOT_COMPARED}


def bucket_names(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """The tensors' names, in order, in buckets of at most bucket_bytes (a bigger tensor gets one alone)."""
    buckets: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


def serialized_bucket(tensors: Mapping[str, torch.Tensor], names: list[str]) -> tuple[bytes, torch.Tensor]:
    """One flattened bucket as update_weights_from_tensor takes it (load_format "flattened_bucket"),
    and the flat tensor the payload refers to: keep it alive until SGLang has loaded it."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(named_tensors=[(name, tensors[name].detach()) for name in names])
    flat = bucket.get_flattened_tensor()
    return MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": bucket.get_metadata()}), flat


def _context_length(config: dict) -> int:
    """The model's context length as SGLang derives it from config.json (the most it lets a request use
    without SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN)."""
    from sglang.srt.utils.hf_transformers.common import get_context_length

    return get_context_length(SimpleNamespace(**config))


@contextlib.contextmanager
def _environment(**variables: str) -> Iterator[None]:
    """`variables` set in os.environ (so in the processes SGLang starts meanwhile), then restored."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _import_sglang(device: str) -> Any:
    """sglang, imported here rather than at module load (it is an optional extra). SGLang decides at
    import time whether it runs on CPU, from SGLANG_USE_CPU_ENGINE."""
    if device == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    try:
        import sglang
    except ImportError as e:
        raise ImportError(
            f"SGLangEngine needs the sglang extra (uv sync --extra sglang, or meshy-infer[sglang]): {e}"
        ) from e
    from sglang.srt.utils import is_cpu

    if device == "cpu" and not is_cpu():
        raise SchemaError(
            "SGLangEngine device 'cpu': sglang was imported before SGLANG_USE_CPU_ENGINE=1 was set "
            "(or this host CPU is not x86-64 or arm64); set it before sglang is first imported"
        )
    return sglang


class _LoopThread:
    """An event loop running on a thread of its own, for every call into SGLang's TokenizerManager."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    async def run(self, coroutine: Coroutine) -> Any:
        """Runs the coroutine on this loop; awaitable from any other loop (cancelling the wait cancels it)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.loop))

    def stop(self) -> None:
        """Cancels what still runs on the loop (SGLang's own receive loops), then stops and closes it."""

        async def cancel_the_rest() -> None:
            rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_the_rest(), self.loop).result(timeout=_CLOSE_TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@dataclass(eq=False)
class _Request:
    """One `generate` call; it may span several SGLang requests (abort-mode pauses resubmit it)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: list[torch.Tensor] | None = None  # each attempt's expert ids [tokens, layers, top_k], if recorded
    rid: str | None = None  # the SGLang request now running for it
    adapter: int | None = None  # the version whose adapter that request names (LoRA)
    aborted: bool = False  # by abort() or close()
    interrupted: bool = False  # ended by an abort-mode pause: continue from its output once resumed

    def result(self, finish_reason: str) -> Generation:
        routed = torch.cat(self.routing) if self.routing is not None else None
        return Generation(
            self.request_id, self.output, self.logprobs, self.versions, finish_reason, len(self.prompt), routed
        )


def _adapter_name(version: int) -> str:
    """SGLang's name of the adapter of a LoRA version: SGLang tracks no weight version per adapter."""
    return f"v{version}"


def _versions_per_token(spans: list[dict], count: int) -> list[int]:
    """SGLang's weight_versions spans [{version, start, end}] as one int version per output token."""
    versions = [int(span["version"]) for span in spans for _ in range(span["start"], span["end"])]
    if len(versions) != count:
        raise SGLangError(f"weight_versions spans {spans} do not cover the {count} output tokens")
    return versions


def _routed_experts(meta: Mapping, count: int, layers: int, top_k: int) -> torch.Tensor:
    """SGLang's routed_experts (base64 of int32 [count, layers, top_k]; absent for an attempt aborted before
    it ran) as one attempt's expert ids."""
    raw = base64.b64decode(meta.get("routed_experts") or "")
    if len(raw) != count * layers * top_k * 4:
        raise SGLangError(
            f"routed_experts: {len(raw) // 4} expert ids for {count} output tokens x {layers} layers x top {top_k}"
        )
    if count == 0:
        return torch.zeros(0, layers, top_k, dtype=EXPERT_ID_DTYPE, device=HOST)
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).view(count, layers, top_k).to(EXPERT_ID_DTYPE)


def _check_settings(
    device: str,
    max_len: int,
    max_running: int | None,
    deterministic: bool,
    colocate: bool,
    weight_sync_rank: int | None,
    server_args: Mapping[str, Any],
) -> None:
    """SGLangEngine's settings that are refused before any weights are read."""
    if max_len < 2:
        raise SchemaError(f"SGLangEngine max_len: expected >= 2 tokens, got {max_len}")
    if max_running is not None and max_running < 1:
        raise SchemaError(f"SGLangEngine max_running: expected >= 1, got {max_running}")
    if clash := sorted(server_args.keys() & _SET_BY.keys()):
        name = clash[0]
        raise SchemaError(f"SGLangEngine {name}: set by SGLangEngine (through {_SET_BY[name]}), not passed on")
    if device == "cpu" and (deterministic or colocate):
        raise SchemaError(
            "SGLangEngine on CPU: deterministic=True needs a GPU attention backend and SGLang's Triton "
            "sampler; colocate=True needs SGLang's CUDA memory saver"
        )
    if weight_sync_rank is not None and weight_sync_rank < 1:
        raise SchemaError(f"SGLangEngine weight_sync_rank: expected >= 1 (0 is the publisher), got {weight_sync_rank}")
    if weight_sync_rank is not None:
        check_loaded()


def _refuse_broadcast_adapters(published: Published) -> None:
    if published.adapter is not None:
        raise SchemaError(
            f"weights v{published.version}: a LoRA version broadcast on the weight-sync group; SGLangEngine takes "
            "LoRA versions from disk, shared memory or tensors in memory (SGLang receives a broadcast into the "
            "model's weights, not into its LoRA adapters)"
        )


def _check_adapters(
    what: str, adapter: Adapter, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], shapes: Mapping
) -> None:
    """Each adapter (A, B) on a weight the model has, of a module the announcement targets, with A [rank, in]
    and B [out, rank] (SGLang would fail on a misshapen adapter in the middle of a batch)."""
    if not pairs:
        raise SchemaError(f"{what}: a LoRA version without adapter tensors")
    for weight, (a, b) in pairs.items():
        if weight not in shapes:
            raise SchemaError(f"{what}: adapter on {weight}, which the model does not have")
        module = weight.split(".")[-2]
        if module not in adapter.target_modules:
            raise SchemaError(
                f"{what}: adapter on {weight}; its module {module!r} is not among the adapter target_modules "
                f"{sorted(adapter.target_modules)}"
            )
        out_features, in_features = shapes[weight]
        if tuple(a.shape) != (adapter.rank, in_features) or tuple(b.shape) != (out_features, adapter.rank):
            raise SchemaError(
                f"{what}: adapter on {weight}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, expected "
                f"{(adapter.rank, in_features)} and {(out_features, adapter.rank)} (rank {adapter.rank})"
            )


@dataclass
class _FirstWeights:
    """What an engine starts from: the model (config.json, tensor shapes), its weights version, and its
    weights: a directory SGLang loads, or (directory None) tensors in memory or a broadcast version that
    SGLangEngine loads once SGLang runs. For a LoRA version: its base's directory, and its adapter's
    tensors (verified, read from its PEFT directory), which SGLangEngine loads once SGLang runs."""

    config: dict
    shapes: dict[str, tuple[int, ...]]
    version: int
    directory: Path | None = None
    tensors: Mapping[str, torch.Tensor] | None = None
    broadcast: Published | None = None
    adapter: Adapter | None = None
    adapter_tensors: dict[str, torch.Tensor] | None = None

    @classmethod
    def of(cls, source: ModelSource, version: int | None, weight_sync_rank: int | None) -> "_FirstWeights":
        """`source` read (a version on disk checked against its checksum); version: by default a
        Published's own, else 0."""
        if isinstance(source, Published):
            return cls._of_published(source, source.version if version is None else version, weight_sync_rank)
        version = 0 if version is None else version
        if isinstance(source, tuple):
            config, tensors = read_model(source)
            return cls(config, {name: tuple(t.shape) for name, t in tensors.items()}, version, tensors=tensors)
        directory = HFDirectory.open(source)
        return cls(directory.config(), directory.shapes(), version, directory=directory.path)

    @classmethod
    def _of_published(cls, source: Published, version: int, weight_sync_rank: int | None) -> "_FirstWeights":
        if source.transport is Transport.COLLECTIVE:
            _refuse_broadcast_adapters(source)
            if weight_sync_rank is None:
                raise SchemaError(
                    f"SGLangEngine source: v{source.version} is broadcast on the weight-sync group; an engine "
                    "that receives it needs its place in the group (weight_sync_rank)"
                )
            meta = json.loads(source.location)
            if "delta" in meta:
                raise SchemaError(
                    f"SGLangEngine source: v{source.version} is a delta; an engine starts from a whole one"
                )
            return cls(meta["config"], BucketLayout.of(meta).shapes, version, broadcast=source)
        if source.transport is not Transport.DISK:
            raise SchemaError(
                f"SGLangEngine source: a {source.transport} version cannot start an engine; start from a "
                f"{Transport.DISK} version, a directory or (config, tensors), then update_weights"
            )
        directory, config, shapes = verify_published(source)  # a LoRA version's: its base's
        if source.adapter is None:
            return cls(config, shapes, version, directory=directory.path)
        _, adapters = read_published(source, held_base=source.adapter.base)  # the base is verified above
        _check_adapters(f"weights v{source.version}", source.adapter, split_version(adapters)[1], shapes)
        return cls(config, shapes, version, directory.path, adapter=source.adapter, adapter_tensors=adapters)

    @contextlib.contextmanager
    def model_path(self) -> Iterator[Path]:
        """The directory SGLang starts from: the weights' own, or a temporary one holding config.json alone."""
        if self.directory is not None:
            yield self.directory
            return
        path = Path(tempfile.mkdtemp(prefix="meshy-sglang-start-"))
        try:
            (path / "config.json").write_text(json.dumps(self.config))
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


class SGLangEngine(Engine):
    """An Engine on an in-process sglang.Engine (see the module docstring for what it can and cannot do).

    source: a Published version on disk (its checksum is verified first) or broadcast (with
    weight_sync_rank), an HF checkpoint directory or (config, tensors); `version` is its weights version
    (by default a Published's own, else 0). `max_len` is the context length (prompt + output),
    `max_running` the most requests decoded at once (by default SGLang's choice from memory).
    `pause_mode`: "retract" or "abort" (see the module docstring). `deterministic`: honour seeds
    (SGLang's deterministic inference; GPU only). `colocate`: enable `release`/`onload` on a GPU
    (SGLang's memory saver; weights backed up in host memory).
    `bucket_bytes`: the most bytes of in-memory weights sent to SGLang in one flattened bucket.
    `stream_interval`: how many tokens SGLang produces between two reports of a request's output.
    `record_routing`: every Generation carries the experts a mixture's layers chose for each output token
    (routing replay; needs pause_mode "abort", see the module docstring). On the CPU the KV cache holds
    max_running requests of max_len tokens (by default SGLang takes most of the free host memory). Other
    keyword arguments are passed to sglang.Engine as they are (mem_fraction_static, max_total_tokens,
    disable_radix_cache, tp_size, ...), except those this class sets itself (SchemaError names the
    parameter to use). Starting takes 20-60 s and blocks; construct it off a running event loop.
    `pause_mode` and `bucket_bytes` may be changed later (they apply from the next hold or update).
    `weight_sync_rank`: the rank of the engine's first scheduler (of tp_size) in the weight-sync group,
    for an engine that receives broadcast versions (it starts from the first one's announcement).
    A LoRA version on disk as `source` starts SGLang with LoRA (see the module docstring); SGLang's
    max_loras_per_batch (2 here) may be passed on.
    """

    def __init__(
        self,
        source: ModelSource,
        *,
        version: int | None = None,
        device: str = "cuda",
        dtype: str = "bfloat16",
        max_len: int = 4096,
        max_running: int | None = None,
        pause_mode: str = "retract",
        deterministic: bool = False,
        colocate: bool = False,
        seed: int = 0,
        bucket_bytes: int = 1 << 30,
        stream_interval: int = 1,
        record_routing: bool = False,
        weight_sync_rank: int | None = None,
        **server_args: Any,
    ):
        _check_settings(device, max_len, max_running, deterministic, colocate, weight_sync_rank, server_args)
        first = _FirstWeights.of(source, version, weight_sync_rank)
        if record_routing and not first.config.get("num_experts"):
            raise SchemaError(
                "SGLangEngine record_routing: the model is dense (config.json has no num_experts); routing "
                "is recorded for a mixture of experts"
            )
        self.config, self._shapes = first.config, first.shapes
        self.vocab_size = int(self.config["vocab_size"])
        self._weight_sync_rank = weight_sync_rank
        self._weight_sync_group: str | None = None  # SGLang's name of the group, once joined
        self._record_routing = record_routing
        self.max_len = max_len
        self._version = first.version
        self._lora = first.adapter  # the rank and target modules SGLang's LoRA started with; None: no LoRA
        self._base = None if first.adapter is None else first.adapter.base  # the base's checksum (LoRA)
        self._base_version = first.version  # SGLang's own weight_version: the version its base weights came with
        self._on_gpu = device != "cpu"
        self._colocate = colocate
        self.pause_mode = pause_mode
        self._deterministic = deterministic
        self.bucket_bytes = bucket_bytes
        self._stream_interval = stream_interval
        self._seed_warned = False
        self._sglang = self._start_sglang(first, device, dtype, max_running, seed, server_args)
        self._tokenizer_manager = self._sglang.tokenizer_manager
        self._stop_at_exit()
        self._start_loop()
        self._load_first(first)

    def _start_sglang(
        self,
        first: _FirstWeights,
        device: str,
        dtype: str,
        max_running: int | None,
        seed: int,
        server_args: Mapping[str, Any],
    ) -> Any:
        """sglang.Engine on `first`'s directory, or on config.json alone with dummy weights (_load_first
        loads them)."""
        sglang = _import_sglang(device)
        model_context = _context_length(self.config)
        if self.max_len > model_context:
            raise SchemaError(
                f"SGLangEngine max_len: expected at most the model's context length ({model_context}, from its "
                f"config.json), got {self.max_len}"
            )
        args = {**self._server_args(device, dtype, max_running, seed, first.directory is None), **server_args}
        # The slack goes past the model's own context when max_len reaches it; SGLang then refuses to
        # start unless told to, and no position past max_len is ever used.
        beyond = args["context_length"] > model_context
        allowed = _environment(SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN="1") if beyond else contextlib.nullcontext()
        with first.model_path() as model_path, allowed:
            return sglang.Engine(model_path=str(model_path), **args)

    def _server_args(
        self, device: str, dtype: str, max_running: int | None, seed: int, starts_empty: bool
    ) -> dict[str, Any]:
        """The sglang.Engine arguments this class sets (_SET_BY, but for model_path), and its own defaults
        for a few others."""
        args = {
            "device": device,
            "dtype": dtype,
            "context_length": self.max_len + _CONTEXT_SLACK,
            "random_seed": seed,
            "skip_tokenizer_init": True,
            "weight_version": str(self._version),
            "enable_deterministic_inference": self._deterministic,
            "enable_memory_saver": self._colocate,
            "enable_weights_cpu_backup": self._colocate,
            "enable_return_routed_experts": self._record_routing,
            "log_level": "error",
        }
        if max_running is not None:
            args["max_running_requests"] = max_running
        if device == "cpu":
            args["attention_backend"] = "torch_native"
            if max_running is not None:  # else SGLang sizes the cache from free host memory: most of it
                args["max_total_tokens"] = max_running * (self.max_len + _CONTEXT_SLACK)
        if starts_empty:  # SGLang starts from config.json alone, its weights filled by _load_first
            args["load_format"] = "dummy"
        if self._lora is not None:
            args |= {
                "enable_lora": True,
                "max_lora_rank": self._lora.rank,
                "lora_target_modules": sorted(self._lora.target_modules),
                "max_loras_per_batch": _LORA_PER_BATCH,
            }
            if device == "cpu":  # SGLang's other LoRA backends are Triton kernels
                args["lora_backend"] = "torch_native"
        return args

    def _stop_at_exit(self) -> None:
        """SGLang's own shutdown at exit kills every child of this process, not only its own: ours kills its
        own."""
        atexit.unregister(self._sglang.shutdown)
        atexit.register(self._stop_sglang_processes)

    def _start_loop(self) -> None:
        """The loop every call into SGLang runs on, with SGLang's receive loop, and what it keeps of requests
        and holds."""
        self._loop = _LoopThread("meshy-sglang")
        self._requests: dict[str, _Request] = {}  # request_id -> its running `generate`
        self._in_flight: set[asyncio.Task] = set()  # generate and score calls, on the loop
        self._submissions = 0  # numbers SGLang rids; a rid is never a prefix of another (SGLang aborts by prefix)
        self._holds: set[str] = set()  # why generation is held: "pause", "update", "release"
        self._gate = asyncio.Condition()  # notified when holds or closing change (used on the loop only)
        self._control = asyncio.Lock()  # one pause/resume/update/release/onload at a time
        self._released = False
        self._adapter: int | None = None  # the version whose adapter every new SGLang request names (LoRA)
        self._adapters_loaded: set[int] = set()  # versions whose adapters SGLang holds
        self._adapter_users: collections.Counter[int] = collections.Counter()  # SGLang requests per adapter
        self._unloading: set[asyncio.Task] = set()
        self._closing = False  # set on the loop: no new SGLang request from now on
        self._close_started = False
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        asyncio.run_coroutine_threadsafe(self._start_receiving(), self._loop.loop).result()

    def _load_first(self, first: _FirstWeights) -> None:
        """The first weights, when SGLang started without them: tensors in memory, or a broadcast version."""
        if first.adapter_tensors is not None:
            loading = self._update_lora_on_loop(first.version, first.adapter, first.adapter_tensors)
        elif first.tensors is not None:
            loading = self._update_from_tensors_on_loop(first.version, first.tensors)
        elif first.broadcast is not None:
            loading = self._update_from_broadcast_on_loop(first.version, first.broadcast)
        else:
            return
        asyncio.run_coroutine_threadsafe(loading, self._loop.loop).result()

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def records_routing(self) -> bool:
        return self._record_routing

    @property
    def lora_base(self) -> str | None:
        """The checksum of the LoRA base SGLang holds (None: the engine serves a whole model)."""
        return self._base

    @property
    def switches_adapters_live(self) -> bool:
        """With LoRA, a version's adapter loads while generation goes on, and requests move onto it here."""
        return self._lora is not None

    @property
    def pause_mode(self) -> str:
        """How generation is held: "retract" or "abort" (may change whenever; the next hold uses it;
        always "abort" while routing is recorded)."""
        return self._pause_mode

    @pause_mode.setter
    def pause_mode(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise SchemaError(f"SGLangEngine pause_mode: expected one of {PAUSE_MODES}, got {mode!r}")
        if mode != "abort" and self._record_routing:
            raise SchemaError(
                f'SGLangEngine pause_mode: expected "abort" with record_routing=True, got {mode!r} (a retracted '
                "request's routing is computed again under the weights it resumes with)"
            )
        self._pause_mode = mode

    @property
    def closed(self) -> bool:
        """True once `close` was called."""
        return self._close_started

    # ---- the public coroutines (input checked by Engine; SGLang calls on the loop) ----

    async def _generate(self, request_id: str, input_ids: list[int], params: SamplingParams) -> Generation:
        if params.seed is not None and not self._deterministic and not self._seed_warned:
            self._seed_warned = True
            log.warning("SGLangEngine without deterministic=True ignores SamplingParams.seed")
        return await self._run(self._generate_on_loop(request_id, input_ids, params))

    async def _score(self, input_ids: list[int], top_k: int, start: int) -> Scores:
        return await self._run(self._score_on_loop(input_ids, top_k, start))

    async def abort(self, request_id: str) -> None:
        await self._run(self._abort_on_loop(request_id))

    async def pause(self) -> None:
        await self._run(self._set_hold_on_loop("pause", True))

    async def resume(self) -> None:
        await self._run(self._set_hold_on_loop("pause", False))

    async def update_weights(self, version: int, source: WeightsSource, adapter: Adapter | None = None) -> None:
        """A Published is verified (and its config compared with the engine's) before SGLang sees it; a
        directory is then loaded by SGLang from disk, tensors are sent in flattened buckets. A corrupt or
        mismatched version raises and leaves the engine on its current weights. `adapter`: for tensors in
        memory, the announcement's (a LoRA version's tensors; a Published says its own); see the class
        docstring for LoRA versions."""
        if self._released and self._on_gpu:
            raise SGLangError(f"weights v{version}: the engine is released; onload() before update_weights")
        if isinstance(source, Published):
            if source.version != version:
                raise SchemaError(f"update_weights version: {version} given for published version {source.version}")
            if adapter is not None and adapter != source.adapter:
                raise SchemaError(
                    f"update_weights adapter: {adapter} given for published version {version}, which announces "
                    f"{source.adapter} (a published version's own is used: pass None)"
                )
            adapter = source.adapter
        if self._lora is not None or adapter is not None:
            await self._update_lora(version, source, adapter)
            return
        if isinstance(source, Published):
            if source.transport is Transport.COLLECTIVE:
                meta = json.loads(source.location)
                if "delta" not in meta:  # a delta's manifest holds its changes; what it rebuilds is verified
                    self._check_model(version, meta["config"], BucketLayout.of(meta).shapes)
                await self._run(self._update_from_broadcast_on_loop(version, source))
                return
            if source.transport is Transport.DISK:
                directory, config, shapes = await asyncio.to_thread(verify_published, source)
                self._check_model(version, config, shapes)
                await self._run(self._update_from_disk_on_loop(version, directory.path))
                return
            config, source = await asyncio.to_thread(read_published, source)  # from shared memory
            self._check_model(version, config, {name: tuple(t.shape) for name, t in source.items()})
        else:  # checked here for the same reason as in _check_model
            check_tensor_shapes(
                f"weights v{version}", {name: tuple(t.shape) for name, t in source.items()}, self._shapes
            )
        await self._run(self._update_from_tensors_on_loop(version, source))

    async def _update_lora(self, version: int, source: WeightsSource, adapter: Adapter | None) -> None:
        """A LoRA version, checked (and a Published verified) before SGLang sees it: its base is loaded only if
        the engine holds another one, then its adapter (_update_lora_on_loop)."""
        what = f"weights v{version}"
        self._check_lora_version(what, adapter)
        base: Path | dict[str, torch.Tensor] | None = None
        if not isinstance(source, Published):
            tensors = source
        elif source.transport is Transport.COLLECTIVE:
            _refuse_broadcast_adapters(source)
        elif source.transport is Transport.DISK and adapter.base != self._base:
            directory, config, shapes = await asyncio.to_thread(verify_published, source)  # adapters and base
            self._check_model(version, config, shapes)
            base = directory.path
            _, tensors = await asyncio.to_thread(read_published, source, adapter.base)  # its adapters alone
        else:
            config, tensors = await asyncio.to_thread(read_published, source, self._base)
        carried, pairs = split_version(tensors)
        if carried and adapter.base != self._base:
            shapes = {name: tuple(t.shape) for name, t in carried.items()}
            if isinstance(source, Published):
                self._check_model(version, config, shapes)
            else:
                check_tensor_shapes(what, shapes, self._shapes)
            base = carried
        if base is None and adapter.base != self._base:
            raise CorruptWeights(
                f"{what}: adapters on base {adapter.base}, and this engine holds base {self._base}; it needs a "
                "version that carries the base"
            )
        _check_adapters(what, adapter, pairs, self._shapes)
        adapters = {name: tensors[name] for name in tensors if name not in carried}
        await self._run(self._update_lora_on_loop(version, adapter, adapters, base))

    def _check_lora_version(self, what: str, adapter: Adapter | None) -> None:
        """SchemaError unless the engine serves LoRA and `adapter` fits what SGLang's LoRA started with."""
        if self._lora is None:
            raise SchemaError(
                f"{what} adapter: a LoRA version ({adapter}), and this engine serves a whole model; SGLang "
                "enables LoRA only at start: start the engine from a LoRA version"
            )
        if adapter is None:
            raise SchemaError(
                f"{what} adapter: none (a whole model's weights), and this engine serves LoRA adapters (it "
                "started from a LoRA version); SGLangEngine does not leave LoRA mode: start another engine"
            )
        if adapter.rank > self._lora.rank:
            raise SchemaError(
                f"{what} adapter rank: {adapter.rank}, above the rank SGLang's LoRA started with "
                f"({self._lora.rank}; max_lora_rank is fixed at start)"
            )
        if beyond := sorted(set(adapter.target_modules) - set(self._lora.target_modules)):
            raise SchemaError(
                f"{what} adapter target_modules: {beyond} beyond those SGLang's LoRA started with "
                f"({sorted(self._lora.target_modules)}; fixed at start)"
            )

    async def release(self) -> None:
        if self._on_gpu and not self._colocate:
            raise SGLangError("SGLangEngine.release needs colocate=True (SGLang's memory saver) at start")
        await self._run(self._release_on_loop())

    async def onload(self) -> None:
        await self._run(self._onload_on_loop())

    async def close(self) -> None:
        """Pending generations end as aborted; later calls raise EngineClosed. Closing twice is a no-op.
        Only SGLang's own child processes are stopped."""
        with self._close_lock:
            first, self._close_started = not self._close_started, True
        if not first:
            await asyncio.to_thread(self._closed.wait)
            return
        try:
            await self._loop.run(self._close_on_loop())
        finally:
            await asyncio.to_thread(self._stop)

    # ---- on the loop ----

    async def _start_receiving(self) -> None:
        self._tokenizer_manager.auto_create_handle_loop()  # SGLang's receive loop, on this loop

    async def _generate_on_loop(self, request_id: str, prompt: list[int], params: SamplingParams) -> Generation:
        if request_id in self._requests:
            raise SchemaError(f"request_id {request_id!r}: a request with this id is already running")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        request = self._requests[request_id] = _Request(request_id, prompt, params, seed)
        if self._record_routing:
            request.routing = []
        self._in_flight.add(asyncio.current_task())
        try:
            while True:
                await self._admitted(request)
                if request.aborted or self._closing:
                    return request.result(FINISH_ABORT)
                finish = await self._submit(request)
                if finish != FINISH_ABORT or not request.interrupted or request.aborted or self._closing:
                    return request.result(finish)
                request.interrupted = False  # an abort-mode pause ended it: continue once resumed
                if len(request.output) == params.max_new_tokens:
                    return request.result(FINISH_LENGTH)
        finally:
            del self._requests[request_id]
            self._in_flight.discard(asyncio.current_task())

    async def _submit(self, request: _Request) -> str:
        """One SGLang request for what is left of `request`; appends its output, returns its finish reason."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        params = request.params
        sampling = {
            "max_new_tokens": params.max_new_tokens - len(request.output),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k or -1,
            "stop_token_ids": list(params.stop_token_ids),
            "stream_interval": self._stream_interval,
        }
        if self._deterministic:
            sampling["sampling_seed"] = request.seed
        request.rid = self._next_rid(request.request_id)
        input_ids = request.prompt + request.output
        # The routing of positions len(input_ids) - 1 onwards: the forwards whose logits gave this attempt's tokens.
        routing = {"return_routed_experts": True, "routed_experts_start_len": len(input_ids) - 1}
        base_version = self._base_version
        try:
            with self._naming_adapter(request) as adapter:
                out = await self._final_response(
                    GenerateReqInput(
                        input_ids=input_ids,
                        sampling_params=sampling,
                        return_logprob=True,
                        rid=request.rid,
                        stream=True,
                        **(routing if self._record_routing else {}),
                        **adapter,
                    )
                )
        finally:
            request.rid = None
        meta = out["meta_info"]
        output_ids = list(out["output_ids"])
        logprobs = [logprob for logprob, _, _ in meta["output_token_logprobs"]]
        versions = _versions_per_token(meta.get("weight_versions") or [], len(output_ids))
        finish = _FINISH_REASONS[meta["finish_reason"]["type"]]
        if request.adapter is not None:
            # LoRA: SGLang's versions are its base's. Tokens after the base changed under the request (it
            # slipped past the switch's abort) come from no published version: dropped, and produced again.
            kept = next((i for i, v in enumerate(versions) if v != base_version), len(versions))
            if kept < len(output_ids):
                output_ids, logprobs, finish = output_ids[:kept], logprobs[:kept], FINISH_ABORT
                request.interrupted = True
            versions = [request.adapter] * kept
        request.output += output_ids
        request.logprobs += logprobs
        request.versions += versions
        if request.routing is not None:
            layers, top_k = int(self.config["num_hidden_layers"]), int(self.config["num_experts_per_tok"])
            count = len(meta["output_token_logprobs"])
            request.routing.append(_routed_experts(meta, count, layers, top_k)[: len(output_ids)])
        return finish

    async def _score_on_loop(self, input_ids: list[int], top_k: int, start: int) -> Scores:
        from sglang.srt.managers.io_struct import GenerateReqInput

        self._in_flight.add(asyncio.current_task())
        try:
            while True:  # an abort-mode pause ends a scoring request too: score again once resumed
                await self._admitted(None)
                if self._closing:
                    raise EngineClosed("the engine was closed")
                with self._naming_adapter(None) as adapter:
                    out = await self._final_response(
                        GenerateReqInput(
                            input_ids=input_ids,
                            sampling_params={"max_new_tokens": 0},
                            return_logprob=True,
                            logprob_start_len=start,
                            top_logprobs_num=top_k,
                            rid=self._next_rid("score"),
                            **adapter,
                        )
                    )
                meta = out["meta_info"]
                if meta["finish_reason"]["type"] != "abort":
                    break
        finally:
            self._in_flight.discard(asyncio.current_task())
        # SGLang's first entry is the logprob of ids[start] (None at 0); Scores starts at ids[start + 1].
        token_logprobs = [logprob for logprob, _, _ in meta["input_token_logprobs"][1:]]
        if top_k == 0:
            return Scores(token_logprobs)
        rows = meta["input_top_logprobs"][1:]
        return Scores(
            token_logprobs,
            [[token for _, token, _ in row] for row in rows],
            [[logprob for logprob, _, _ in row] for row in rows],
        )

    async def _final_response(self, request: Any) -> dict:
        responses = self._tokenizer_manager.generate_request(request, None)
        try:
            async for response in responses:
                final = response
        finally:
            await responses.aclose()
        return final

    def _next_rid(self, name: str) -> str:
        self._submissions += 1
        return f"{self._submissions}/{name}"

    async def _admitted(self, request: _Request | None) -> None:
        """Returns once generation is not held (or the request was aborted, or the engine is closing)."""
        async with self._gate:
            await self._gate.wait_for(
                lambda: not self._holds or self._closing or (request is not None and request.aborted)
            )

    async def _notify_gate(self) -> None:
        async with self._gate:
            self._gate.notify_all()

    async def _abort_on_loop(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None or request.aborted:
            return
        request.aborted = True
        if request.rid is not None:
            self._tokenizer_manager.abort_request(rid=request.rid)
        await self._notify_gate()

    async def _hold(self, reason: str) -> None:
        """Holds generation for `reason` (SGLang pauses when the first reason appears)."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        first = not self._holds
        self._holds.add(reason)  # before pausing: requests arriving meanwhile wait here
        if first:
            if self._pause_mode == "abort":
                for request in self._requests.values():
                    request.interrupted = request.rid is not None
            await self._tokenizer_manager.pause_generation(PauseGenerationReqInput(mode=self._pause_mode))

    async def _unhold(self, reason: str) -> None:
        """Lets go of `reason`; generation continues when no reason is left."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        if reason not in self._holds:
            return
        self._holds.discard(reason)
        if not self._holds:
            await self._tokenizer_manager.continue_generation(
                ContinueGenerationReqInput(torch_empty_cache=self._on_gpu)
            )
            await self._notify_gate()

    async def _set_hold_on_loop(self, reason: str, held: bool) -> None:
        async with self._control:
            await (self._hold(reason) if held else self._unhold(reason))

    @contextlib.asynccontextmanager
    async def _held_for_update(self):
        """Generation held around a weight update, so it lands between decode steps (SGLang would
        otherwise wait for every running request to finish)."""
        async with self._control:
            await self._hold("update")
            try:
                yield
            finally:
                await self._unhold("update")

    async def _update_from_disk_on_loop(self, version: int, directory: Path) -> None:
        async with self._held_for_update():
            await self._load_directory(version, directory)
            self._version = version

    async def _load_directory(self, version: int, directory: Path) -> None:
        """SGLang loads the weights of `version` from `directory` (generation held)."""
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        # load_format named: an engine started from tensors in memory has SGLang's "dummy" as its own
        request = UpdateWeightFromDiskReqInput(
            model_path=str(directory), load_format="auto", weight_version=str(version)
        )
        success, message, _ = await self._tokenizer_manager.update_weights_from_disk(request, None)
        if not success:
            raise SGLangError(f"weights v{version} from {directory}: {message}")

    async def _update_from_tensors_on_loop(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        async with self._held_for_update():
            await self._load_tensors(version, tensors)
            self._version = version

    async def _load_tensors(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """In a weight-update session (SGLang 0.5.23 refuses tensor updates outside one), one call per
        flattened bucket; the last one flushes the cache and sets the version (generation held)."""
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        if any(tensor.is_cuda for tensor in tensors.values()):
            # CUDA tensors travel as IPC handles keyed by device uuid. (The patch breaks sharing CPU
            # tensors in this process, so only where there are CUDA tensors to send.)
            monkey_patch_torch_reductions()
        success, message = await self._tokenizer_manager.begin_weight_update(BeginWeightUpdateReqInput(), None)
        if not success:
            raise SGLangError(f"weights v{version}: begin_weight_update: {message}")
        try:
            buckets = bucket_names(tensors, self.bucket_bytes)
            for i, names in enumerate(buckets):
                payload, flat = await asyncio.to_thread(serialized_bucket, tensors, names)
                last = i == len(buckets) - 1
                request = UpdateWeightsFromTensorReqInput(
                    serialized_named_tensors=[payload] * self._sglang.server_args.tp_size,
                    load_format="flattened_bucket",
                    flush_cache=last,
                    weight_version=str(version) if last else None,
                )
                success, message = await self._tokenizer_manager.update_weights_from_tensor(request, None)
                del flat  # loaded: free it before the next bucket is built
                if not success:
                    raise SGLangError(f"weights v{version} (bucket {i}; weights may be partly loaded): {message}")
        finally:
            ended, end_message = await self._tokenizer_manager.end_weight_update(EndWeightUpdateReqInput(), None)
        if not ended:
            raise SGLangError(f"weights v{version}: end_weight_update: {end_message}")

    async def _update_lora_on_loop(
        self,
        version: int,
        adapter: Adapter,
        adapters: Mapping[str, torch.Tensor],
        base: Path | Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Loads the version's adapter as SGLang's adapter "v{version}" while generation goes on; with a new
        base (a directory or tensors), loads it next, generation held; then switches to the adapter."""
        async with self._control:
            await self._load_adapter(version, adapter, adapters)
            if base is None:
                self._switch_adapter(version)
                return
            await self._hold("update")
            try:
                await (self._load_directory if isinstance(base, Path) else self._load_tensors)(version, base)
                self._base, self._base_version = adapter.base, version
                self._switch_adapter(version)
            finally:
                await self._unhold("update")

    async def _load_adapter(self, version: int, adapter: Adapter, adapters: Mapping[str, torch.Tensor]) -> None:
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        if version in self._adapters_loaded:
            if version == self._adapter or self._adapter_users[version]:
                raise SchemaError(f"weights v{version}: its adapter is loaded already and in use")
            await self._unload_adapter(version)
        on_host = {name: tensor.to(HOST) for name, tensor in adapters.items()}
        payload = await asyncio.to_thread(MultiprocessingSerializer.serialize, on_host)
        request = LoadLoRAAdapterFromTensorsReqInput(
            lora_name=_adapter_name(version),
            config_dict=adapter.peft_config(""),
            serialized_named_tensors=[payload] * self._sglang.server_args.tp_size,
        )
        result = await self._tokenizer_manager.load_lora_adapter_from_tensors(request, None)
        if not result.success:
            raise SGLangError(f"weights v{version}: SGLang did not load the adapter: {result.error_message}")
        self._adapters_loaded.add(version)

    def _switch_adapter(self, version: int) -> None:
        """Every SGLang request from now on names the adapter of `version`; those running on another adapter
        are aborted and continue from their output so far (a running SGLang request cannot change adapter)."""
        self._adapter = self._version = version
        for request in self._requests.values():
            if request.rid is not None and request.adapter != version:
                request.interrupted = True
                self._tokenizer_manager.abort_request(rid=request.rid)
        self._unload_unused()

    def _unload_unused(self) -> None:
        """Unloads, in the background, the adapters of versions that no SGLang request names and that new ones
        will not name. (SGLang's unload waits for the requests naming the adapter and holds every other load
        meanwhile: only adapters no request names are unloaded.)"""
        for version in sorted(self._adapters_loaded - {self._adapter}):
            if not self._adapter_users[version]:
                self._adapters_loaded.discard(version)
                task = asyncio.ensure_future(self._unload_adapter(version))
                self._unloading.add(task)
                task.add_done_callback(self._unloading.discard)

    async def _unload_adapter(self, version: int) -> None:
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        self._adapters_loaded.discard(version)
        request = UnloadLoRAAdapterReqInput(lora_name=_adapter_name(version))
        result = await self._tokenizer_manager.unload_lora_adapter(request, None)
        if not result.success:
            log.warning("SGLang did not unload the adapter of weights v%d: %s", version, result.error_message)

    @contextlib.contextmanager
    def _naming_adapter(self, request: _Request | None) -> Iterator[dict[str, str]]:
        """The fields of an SGLang request that name the current adapter (none without LoRA); the adapter
        counts as in use until the request ends."""
        version = self._adapter
        if request is not None:
            request.adapter = version
        if version is None:
            yield {}
            return
        self._adapter_users[version] += 1
        try:
            yield {"lora_path": _adapter_name(version)}
        finally:
            self._adapter_users[version] -= 1
            if version != self._adapter and not self._adapter_users[version]:
                self._unload_unused()

    async def _update_from_broadcast_on_loop(self, version: int, published: Published) -> None:
        """Join the weight-sync group the first time (where the announcement says), then receive the
        version in SGLang's schedulers, where the plugin verifies it before SGLang loads it: a version
        that fails its checks (CorruptWeights) leaves the engine on its current weights."""
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            InitWeightsUpdateGroupReqInput,
            UpdateWeightsFromDistributedReqInput,
        )

        if self._weight_sync_rank is None:
            raise SchemaError(
                f"weights v{version} are broadcast on the weight-sync group, and this engine is not in it "
                "(weight_sync_rank)"
            )
        async with self._held_for_update():
            if self._weight_sync_group is None:
                place = json.loads(published.location).get("rendezvous")
                if place is None:
                    raise SchemaError(
                        f"weights v{version}: the announcement does not say where the weight-sync group meets "
                        "(its publisher must host the group for engines that join it themselves)"
                    )
                request = InitWeightsUpdateGroupReqInput(
                    master_address=place["address"],
                    master_port=place["port"],
                    rank_offset=self._weight_sync_rank,
                    world_size=place["size"],
                    group_name=place["group"],
                    backend="gloo",
                )
                joined, message = await self._tokenizer_manager.init_weights_update_group(request, None)
                if not joined:
                    raise WeightSyncError(f"weights v{version}: SGLang could not join the weight-sync group: {message}")
                self._weight_sync_group = place["group"]
            success, message = await self._tokenizer_manager.begin_weight_update(BeginWeightUpdateReqInput(), None)
            if not success:
                raise SGLangError(f"weights v{version}: begin_weight_update: {message}")
            try:
                request = UpdateWeightsFromDistributedReqInput(
                    **receive_request(published), group_name=self._weight_sync_group, weight_version=str(version)
                )
                success, message = await self._tokenizer_manager.update_weights_from_distributed(request, None)
            finally:
                ended, end_message = await self._tokenizer_manager.end_weight_update(EndWeightUpdateReqInput(), None)
            if not success and NOT_VERIFIED in message:
                raise CorruptWeights(message.split(NOT_VERIFIED, 1)[1])
            if not success:
                raise WeightSyncError(f"weights v{version}: SGLang's receive failed: {message}")
            if not ended:
                raise SGLangError(f"weights v{version}: end_weight_update: {end_message}")
            self._version = version

    async def _release_on_loop(self) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        async with self._control:
            if self._released:
                return
            await self._hold("release")
            if self._on_gpu:
                await self._tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None)
            self._released = True

    async def _onload_on_loop(self) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        async with self._control:
            if not self._released:
                return
            if self._on_gpu:
                await self._tokenizer_manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(), None)
            self._released = False
            await self._unhold("release")

    async def _close_on_loop(self) -> None:
        """Every generation ends as aborted with its output so far (and every scoring with EngineClosed):
        the held ones are let go, the running ones aborted in SGLang (again every half second, for
        requests SGLang had not yet queued)."""
        self._closing = True
        for request in self._requests.values():
            request.aborted = True
        await self._notify_gate()
        deadline = asyncio.get_running_loop().time() + _CLOSE_TIMEOUT_S
        while self._in_flight and asyncio.get_running_loop().time() < deadline:
            self._tokenizer_manager.abort_request(abort_all=True)
            await asyncio.wait(set(self._in_flight), timeout=0.5)

    # ---- helpers on the caller's side ----

    async def _run(self, coroutine: Coroutine) -> Any:
        if self._close_started:
            coroutine.close()
            raise EngineClosed("the engine was closed")
        return await self._loop.run(coroutine)

    def _stop(self) -> None:
        try:
            self._stop_sglang_processes()
            atexit.unregister(self._stop_sglang_processes)
            self._loop.stop()
        finally:
            self._closed.set()

    def _stop_sglang_processes(self) -> None:
        """Stops SGLang's watchdog (it would take the exits below for a crash), then SGLang's processes,
        and reaps them (they are multiprocessing children of this process)."""
        from sglang.srt.utils import kill_process_tree

        watchdog = getattr(self._tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        pids = set(self._sglang.get_all_child_pids())
        for pid in pids:
            kill_process_tree(pid)
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S  # kill_process_tree may return before they are zombies
        while pids & {child.pid for child in multiprocessing.active_children()} and time.monotonic() < deadline:
            time.sleep(0.01)

    def _check_model(self, version: int, config: Mapping, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Checked before SGLang sees a version: it would load a partial or misshapen one halfway, then fail."""
        if _model_identity(config) != _model_identity(self.config):
            raise SchemaError(f"weights v{version}: config.json describes another model than the engine's")
        check_tensor_shapes(f"weights v{version}", shapes, self._shapes)
