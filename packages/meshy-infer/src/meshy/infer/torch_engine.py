"""TorchEngine: the pure-torch reference engine, on CPU or one GPU.

One worker thread owns the model and the KV cache. The coroutines check their input, post a command to
the worker and await its future, so the event loop stays free while tokens are computed (and a loop
that also blocks elsewhere does not stall generation). Each scheduler iteration applies the commands
that arrived, in order (weights, pause, release, abort, new requests, scores); admits waiting requests
into free cache slots, one prefill each; then runs one batched decode step for every running request.
Nothing waits forever: `close()` ends pending generations as aborted, and if the worker fails, every
pending call raises EngineClosed naming the cause.
"""

import asyncio
import contextlib
import json
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from meshy.dataplane import SchemaError
from meshy.dataplane.weights import DTYPES, Published, read_published
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
from meshy.infer.torch_model import DecoderModel, KVCache, ModelConfig, load_model

# A published version (verified), an HF checkpoint directory (config.json and *.safetensors, sharded or
# not), or a config.json dict with HF-named tensors.
ModelSource = Published | str | os.PathLike | tuple[Mapping, Mapping[str, torch.Tensor]]
PREFILL_TOKENS = 8192  # padded prompt tokens one prefill forward takes at most (bounds its activations)


def read_model(source: ModelSource) -> tuple[dict, Mapping[str, torch.Tensor]]:
    """(config.json as a dict, HF name -> tensor) of a model source."""
    if isinstance(source, Published):
        return read_published(source)
    if isinstance(source, tuple):
        config, tensors = source
        return dict(config), tensors
    directory = Path(source)
    shards = sorted(directory.glob("*.safetensors"))
    if not (directory / "config.json").is_file() or not shards:
        raise SchemaError(f"model source {directory}: expected config.json and *.safetensors in a directory")
    config = config_json(directory / "config.json")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            tensors.update(load_file(shard))
        except (SafetensorError, OSError) as e:  # a truncated or garbled file: no checksum to tell us more
            raise SchemaError(f"model source {shard}: not a readable safetensors file ({e})") from None
    return config, tensors


def config_json(path: Path) -> dict:
    """A model directory's config.json as a dict, or a SchemaError naming the file."""
    try:
        config = json.loads(path.read_bytes())
    except ValueError as e:
        raise SchemaError(f"model source {path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise SchemaError(f"model source {path}: expected a JSON object, got {type(config).__name__}")
    return config


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    done: Future
    generator: torch.Generator | None = None  # made on the worker's device when admitted
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    slot: int = -1
    cached: int = 0  # tokens whose keys and values are in the cache


@dataclass(eq=False)
class _Call:
    """A command for the worker: `fn` runs there, in order with every other command."""

    fn: Callable[[], object]
    done: Future
    needs_device: bool = False  # held while released, run after onload


def _draw(scaled: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token from softmax(scaled logits) truncated to the top k, then to the top-p nucleus."""
    if 0 < top_k < scaled.numel():
        kept = scaled.topk(top_k)
        scaled = torch.full_like(scaled, -torch.inf).scatter_(0, kept.indices, kept.values)
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        beyond = sorted_probs.cumsum(0) - sorted_probs >= top_p  # the tokens before them already hold p
        probs[order[beyond]] = 0
    return torch.multinomial(probs, 1, generator=generator)[0]


def _truncated(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab or params.top_p < 1


def sample(logits: torch.Tensor, requests: Sequence[_Request]) -> tuple[list[int], list[float]]:
    """The next token of each row of float32 logits [batch, vocab], and its logprob: the log-softmax of
    logits / temperature (1 when greedy) at that token, before top-k/top-p truncation.

    Rows sampled from the full distribution (the RL case) are drawn together by inverting their CDFs,
    each at one uniform from its own request's generator: a request's tokens depend only on its seed,
    not on what else is in the batch, and a step costs one draw per row instead of one per vocabulary
    entry (torch.multinomial draws an exponential for every token). Rows with top-k/top-p go one by one."""
    temperatures = [r.params.temperature or 1.0 for r in requests]
    scaled = logits / torch.tensor(temperatures, device=logits.device)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    chosen = logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    full = [i for i, r in enumerate(requests) if r.params.temperature > 0 and not _truncated(r.params, vocab)]
    if full:
        rows = torch.tensor(full, device=logits.device)
        cdf = logprobs[rows].exp().cumsum(dim=-1)
        uniforms = torch.cat([torch.rand(1, generator=requests[i].generator, device=logits.device) for i in full])
        drawn = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
        chosen[rows] = drawn.clamp(max=vocab - 1)
    for i, request in enumerate(requests):
        if request.params.temperature > 0 and _truncated(request.params, vocab):
            chosen[i] = _draw(scaled[i], request.params.top_k, request.params.top_p, request.generator)
    return chosen.tolist(), logprobs.gather(1, chosen[:, None])[:, 0].tolist()


def _prefill_chunks(requests: list[_Request], length: Callable[[_Request], int]) -> list[list[_Request]]:
    """Consecutive runs of requests whose prefill, padded to the run's longest, stays within PREFILL_TOKENS
    (a request longer than that alone is one run)."""
    chunks: list[list[_Request]] = []
    longest = 0
    for request in requests:
        longest_with = max(longest, length(request))
        if chunks and longest_with * (len(chunks[-1]) + 1) <= PREFILL_TOKENS:
            chunks[-1].append(request)
            longest = longest_with
        else:
            chunks.append([request])
            longest = length(request)
    return chunks


class _Scheduler:
    """The worker thread's state: model, cache, requests. Only the worker thread touches it."""

    def __init__(
        self,
        model: DecoderModel,
        config: ModelConfig,
        max_running: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        version: int,
    ):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.max_running, self.max_len = max_running, max_len
        self.version = version
        self.cache: KVCache | None = KVCache(config, max_running, max_len, device, dtype)
        self.waiting: deque[_Request] = deque()
        self.running: dict[int, _Request] = {}  # slot -> request
        self.free_slots = list(reversed(range(max_running)))
        self.held: list[_Call] = []
        self.paused = self.released = self.closed = False

    def busy(self) -> bool:
        return not (self.paused or self.released) and bool(self.waiting or self.running)

    def apply(self, command: _Request | _Call) -> None:
        if not command.done.set_running_or_notify_cancel():
            return  # the caller gave up before the worker saw it
        if isinstance(command, _Request):
            self.waiting.append(command)
        elif command.needs_device and self.released:
            self.held.append(command)
        else:
            self._run(command)

    @staticmethod
    def _run(call: _Call) -> None:
        try:
            call.done.set_result(call.fn())
        except Exception as e:
            call.done.set_exception(e)

    def step(self) -> None:
        """Admit what fits (their prompts prefilled together, up to PREFILL_TOKENS padded tokens per
        forward), then one decode step for every running request."""
        admitted: list[_Request] = []
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            if request.params.max_new_tokens == 0:
                self._finish(request, FINISH_LENGTH)
                continue
            request.slot = self.free_slots.pop()
            self.running[request.slot] = request
            admitted.append(request)
        for chunk in _prefill_chunks(admitted, lambda r: len(r.prompt)):
            self._prefill(chunk)
        if self.running:
            self._decode()

    def _prefill(self, requests: list[_Request]) -> None:
        for request in requests:
            request.generator = torch.Generator(self.device)
            if request.params.seed is None:
                request.generator.seed()
            else:
                request.generator.manual_seed(request.params.seed)
        prompts = [torch.tensor(r.prompt, device=self.device) for r in requests]
        logits = self.model.prefill(prompts, self.cache, [r.slot for r in requests])
        for request in requests:
            request.cached = len(request.prompt)
        self._emit(requests, logits)

    def _refill(self, requests: list[_Request]) -> None:
        """Recompute running requests' caches (dropped by `release`); each one's last token is fed next step."""
        sequences = [(r.prompt + r.output)[:-1] for r in requests]
        tensors = [torch.tensor(s, device=self.device) for s in sequences]
        self.model.prefill(tensors, self.cache, [r.slot for r in requests])
        for request, sequence in zip(requests, sequences, strict=True):
            request.cached = len(sequence)

    def _decode(self) -> None:
        requests = [self.running[slot] for slot in sorted(self.running)]
        tokens = torch.tensor([r.output[-1] for r in requests], device=self.device)
        slots = torch.tensor([r.slot for r in requests], device=self.device)
        positions = torch.tensor([r.cached for r in requests], device=self.device)
        logits = self.model.decode(tokens, self.cache, slots, positions)
        for request in requests:
            request.cached += 1
        self._emit(requests, logits)

    def _emit(self, requests: list[_Request], logits: torch.Tensor) -> None:
        tokens, logprobs = sample(logits, requests)
        for request, token, logprob in zip(requests, tokens, logprobs, strict=True):
            request.output.append(token)
            request.logprobs.append(logprob)
            request.versions.append(self.version)
            if token in request.stop_ids:
                self._finish(request, FINISH_STOP)
            elif len(request.output) >= request.params.max_new_tokens:
                self._finish(request, FINISH_LENGTH)

    def _finish(self, request: _Request, reason: str) -> None:
        if self.running.get(request.slot) is request:
            del self.running[request.slot]
            self.free_slots.append(request.slot)
        result = Generation(
            request.request_id, request.output, request.logprobs, request.versions, reason, len(request.prompt)
        )
        request.done.set_result(result)

    def abort(self, request_id: str) -> None:
        for request in [*self.waiting, *self.running.values()]:
            if request.request_id == request_id:
                if request in self.waiting:
                    self.waiting.remove(request)
                self._finish(request, FINISH_ABORT)

    def set_paused(self, paused: bool) -> None:
        self.paused = paused

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.model.load_weights(tensors)
        self.version = version

    def score(self, input_ids: list[int], top_k: int, start: int) -> Scores:
        tokens = torch.tensor([input_ids], device=self.device)
        logprobs = torch.log_softmax(self.model.score_logits(tokens, start)[0], dim=-1)
        chosen = logprobs.gather(1, tokens[0, start + 1 :, None])[:, 0].tolist()
        if top_k == 0:
            return Scores(chosen)
        top = logprobs.topk(top_k, dim=-1)
        return Scores(chosen, top.indices.tolist(), top.values.tolist())

    def release(self) -> None:
        if self.released:
            return
        self.released, self.cache = True, None
        if self.device.type != "cpu":
            self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        if not self.released:
            return
        self.model.to(self.device)
        self.cache = KVCache(self.config, self.max_running, self.max_len, self.device, self.dtype)
        running = list(self.running.values())
        for chunk in _prefill_chunks(running, lambda r: len(r.prompt) + len(r.output) - 1):
            self._refill(chunk)
        self.released = False
        held, self.held = self.held, []
        for call in held:
            self._run(call)

    def close(self) -> None:
        """Abort every request (the output so far is returned); the calls held for onload raise."""
        for request in [*self.waiting, *self.running.values()]:
            self._finish(request, FINISH_ABORT)
        self.fail("the engine was closed")

    def fail(self, reason: str) -> None:
        """Every request and held call still pending raises EngineClosed(reason); the worker stops."""
        self.closed = True
        for pending in [*self.waiting, *self.running.values(), *self.held]:
            pending.done.set_exception(EngineClosed(reason))
        self.waiting.clear()
        self.running.clear()
        self.held.clear()


class TorchEngine(Engine):
    """The reference engine: continuous batching over `max_running` cache slots of `max_len` tokens
    each (prompt + output), on `device` in `dtype` ("float32", "bfloat16" or "float16").

    `source` is a ModelSource; `version` is its weights version (by default a Published's own, else 0).
    `release` drops the KV cache and, on an accelerator, moves the weights to host memory; running
    requests keep their slots and their caches are recomputed by `onload`.
    """

    def __init__(
        self,
        source: ModelSource,
        *,
        max_running: int = 32,
        max_len: int = 2048,
        device: str | torch.device = "cpu",
        dtype: str = "float32",
        version: int | None = None,
    ):
        if max_running < 1:
            raise SchemaError(f"TorchEngine max_running: expected >= 1, got {max_running}")
        if max_len < 2:
            raise SchemaError(f"TorchEngine max_len: expected >= 2 tokens, got {max_len}")
        if dtype not in DTYPES:
            raise SchemaError(f"TorchEngine dtype: expected one of {list(DTYPES)}, got {dtype!r}")
        config, tensors = read_model(source)
        self.config = ModelConfig.from_hf(config)
        self.max_len = max_len
        if version is None:
            version = source.version if isinstance(source, Published) else 0
        device = torch.device(device)
        model = load_model(self.config, tensors, device, DTYPES[dtype])
        self._scheduler = _Scheduler(model, self.config, max_running, max_len, device, DTYPES[dtype], version)
        self._inbox: queue.SimpleQueue[_Request | _Call] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopped: str | None = None  # why no command will be run any more
        self._closing = False
        self._active: set[str] = set()
        self._thread = threading.Thread(target=self._work, name="meshy-torch-engine", daemon=True)
        self._thread.start()

    @property
    def weight_version(self) -> int:
        return self._scheduler.version

    # ---- the public coroutines ----

    async def generate(self, request_id: str, input_ids: list[int], params: SamplingParams) -> Generation:
        self._check_ids(input_ids)
        total = len(input_ids) + params.max_new_tokens
        if total > self.max_len:
            raise SchemaError(
                f"input_ids + max_new_tokens: {len(input_ids)} + {params.max_new_tokens} = {total} tokens, "
                f"beyond the engine's max_len of {self.max_len}"
            )
        with self._lock:
            if request_id in self._active:
                raise SchemaError(f"request_id {request_id!r}: a request with this id is already running")
            self._active.add(request_id)
        stop_ids = frozenset(self.config.eos_token_ids) | frozenset(params.stop_token_ids)
        request = _Request(request_id, list(input_ids), params, stop_ids, Future())
        try:
            self._post(request)
            return await asyncio.wrap_future(request.done)
        except asyncio.CancelledError:
            with contextlib.suppress(EngineClosed):
                self._post(_Call(partial(self._scheduler.abort, request_id), Future()))  # free its slot
            raise
        finally:
            with self._lock:
                self._active.discard(request_id)

    async def score(self, input_ids: list[int], top_k: int = 0, start: int = 0) -> Scores:
        self._check_ids(input_ids)
        if not 0 <= top_k <= self.config.vocab_size:
            raise SchemaError(f"score top_k: expected 0..{self.config.vocab_size}, got {top_k}")
        if not 0 <= start < len(input_ids):
            raise SchemaError(f"score start: expected a position in 0..{len(input_ids) - 1}, got {start}")
        return await self._call(partial(self._scheduler.score, list(input_ids), top_k, start), needs_device=True)

    async def abort(self, request_id: str) -> None:
        await self._call(partial(self._scheduler.abort, request_id))

    async def pause(self) -> None:
        await self._call(partial(self._scheduler.set_paused, True))

    async def resume(self) -> None:
        await self._call(partial(self._scheduler.set_paused, False))

    async def update_weights(self, version: int, source: WeightsSource) -> None:
        """A Published is read and verified off the worker (generation goes on meanwhile); a corrupt or
        mismatched version raises and leaves the engine on its current weights."""
        if isinstance(source, Published):
            if source.version != version:
                raise SchemaError(f"update_weights version: {version} given for published version {source.version}")
            config, source = await asyncio.to_thread(read_published, source)
            if ModelConfig.from_hf(config) != self.config:
                raise SchemaError(f"weights v{version}: config.json describes another model than the engine's")
        await self._call(partial(self._scheduler.load_weights, version, source))

    async def release(self) -> None:
        await self._call(self._scheduler.release)

    async def onload(self) -> None:
        await self._call(self._scheduler.onload)

    async def close(self) -> None:
        """Pending generations end as aborted; later calls raise EngineClosed. Closing twice is a no-op."""
        call = _Call(self._scheduler.close, Future())
        with self._lock:
            first = not self._closing and self._stopped is None
            self._closing = True
            if first:
                self._inbox.put(call)
        if first:
            await asyncio.wrap_future(call.done)
        await asyncio.to_thread(self._thread.join)

    # ---- the worker thread ----

    def _work(self) -> None:
        reason = "the engine was closed"
        try:
            with torch.no_grad():
                while not self._scheduler.closed:
                    for command in self._receive():
                        self._scheduler.apply(command)
                    if self._scheduler.busy():
                        self._scheduler.step()
        except Exception as e:
            reason = f"the engine's worker failed: {e!r}"
            self._scheduler.fail(reason)
        finally:
            with self._lock:
                self._stopped = reason
            while not self._inbox.empty():  # posted after the last command the worker ran
                command = self._inbox.get()
                if command.done.set_running_or_notify_cancel():
                    command.done.set_exception(EngineClosed(reason))

    def _receive(self) -> list[_Request | _Call]:
        """Every command posted so far; when there is nothing to compute, wait for the next one."""
        commands = [] if self._scheduler.busy() else [self._inbox.get()]
        while not self._inbox.empty():
            commands.append(self._inbox.get())
        return commands

    # ---- helpers on the caller's side ----

    def _post(self, command: _Request | _Call) -> None:
        with self._lock:
            if self._stopped is not None:
                raise EngineClosed(self._stopped)
            self._inbox.put(command)

    async def _call(self, fn: Callable[[], object], needs_device: bool = False):
        call = _Call(fn, Future(), needs_device)
        self._post(call)
        return await asyncio.wrap_future(call.done)

    def _check_ids(self, input_ids: list[int]) -> None:
        if not input_ids:
            raise SchemaError("input_ids: empty; expected at least one token id")
        vocab = self.config.vocab_size
        for i, token in enumerate(input_ids):
            if not isinstance(token, int) or not 0 <= token < vocab:
                raise SchemaError(f"input_ids[{i}]: token id {token!r} is outside the vocabulary [0, {vocab})")
