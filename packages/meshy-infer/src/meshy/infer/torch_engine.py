"""TorchEngine: the pure-torch reference engine, on CPU or one GPU.

One worker thread owns the model and the KV cache. The coroutines check their input, post a command to
the worker and await its future, so the event loop stays free while tokens are computed (and a loop
that also blocks elsewhere does not stall generation). Each scheduler iteration applies the commands
that arrived, in order (weights, pause, release, abort, new requests, scores); admits waiting requests
into the lowest free cache slots once a sixteenth of the slots are free (or all waiting requests fit),
their prompts prefilled together; then runs one decode step for every running request, sampled
together on the device (meshy.infer.sampling), with one wait for the device per step. What each slot
feeds and draws next stays on the device and each step advances it there (meshy.infer.slot_state). On
CUDA a whole decode step (forward, sampling, advance) is a replayed CUDA graph, one per batch/span
bucket (dense models; a mixture decodes eagerly). A mixture's generations also carry the experts every
layer chose for each token, read back in the same copy as the sampled tokens.
Nothing waits forever: `close()` ends pending generations as aborted, and if the worker fails, every
pending call raises EngineClosed naming the cause.
"""

import asyncio
import contextlib
import heapq
import logging
import queue
import secrets
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

import torch

from meshy.dataplane import HOST, SchemaError, free_bytes, free_cached
from meshy.dataplane.adapters import Adapter, split_version
from meshy.dataplane.model_source import ModelSource, read_model
from meshy.dataplane.weights import DTYPES, CorruptWeights, Published, read_published
from meshy.infer import sampling
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
from meshy.infer.routing_log import EXPERT_ID_DTYPE, RoutingLog
from meshy.infer.slot_state import Slots, SlotState, take
from meshy.infer.torch_model import DecoderModel, KVCache, ModelConfig, load_model

PREFILL_TOKENS = 8192  # padded prompt tokens one prefill forward takes at most (bounds its activations)
SPAN_STEP = 64  # decode attention spans are multiples of it (decode_shape)
# Waiting requests are admitted once 1/ADMISSION_SHARE of the slots are free (or all of them fit): as
# requests finish one or two per step, admitting each at once costs a prefill forward per step, which
# on a GPU takes longer than the decode step itself (launch-bound); a few steps' wait batches them.
ADMISSION_SHARE = 16
log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    done: Future
    seed: int = 0  # fixed when admitted: the params' seed, or a random one
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    slot: int = -1
    cached: int = 0  # tokens whose keys and values are in the cache
    routing: RoutingLog | None = None  # a mixture's experts per output token


@dataclass(eq=False)
class _Call:
    """A command for the worker: `fn` runs there, in order with every other command."""

    fn: Callable[[], object]
    done: Future
    needs_device: bool = False  # held while released, run after onload


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


def decode_shape(slots: Sequence[int], positions: Sequence[int], max_running: int, max_len: int) -> tuple[int, int]:
    """(batch, span) of a decode step over the running slots at their positions: the slots 0..batch-1 with
    batch a power of two, attending over span cache positions (a multiple of 64, at most a quarter more
    than needed). Few distinct shapes, so each can be a CUDA graph."""
    batch = min(max_running, 1 << max(slots).bit_length())
    needed = max(positions) + 1
    step = max(SPAN_STEP, 1 << max(0, (needed - 1).bit_length() - 2))
    return batch, min(max_len, -(-needed // step) * step)


class _CompiledOrEager:
    """`fn` through torch.compile (shapes dynamic: each kind of call compiles once, seconds to a minute),
    until compiling fails (a CPU host without a C++ compiler, an op the compiler cannot lower): then `fn`
    itself for good, and `failures` says why. A compile error is raised before anything ran, so the
    eager call that follows does the work once."""

    def __init__(self, fn: Callable, failures: list[str]):
        self.fn, self.compiled, self.failures = fn, torch.compile(fn, dynamic=True), failures

    def __call__(self, *args: object) -> object:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except torch._dynamo.exc.TorchDynamoException as e:
                self.compiled = None
                self.failures.append(f"torch.compile of {self.fn.__name__} failed, running it eagerly: {e!r}")
                log.warning(self.failures[-1])
        return self.fn(*args)


def _adapter_of(source: object, adapter: Adapter | None) -> Adapter | None:
    """A source's adapters: a Published's own (`adapter`, if given, must be those), else `adapter`."""
    if not isinstance(source, Published):
        return adapter
    if adapter is not None and adapter != source.adapter:
        raise SchemaError(
            f"adapter: {adapter} given for published version {source.version}, which has {source.adapter}"
        )
    return source.adapter


def _int64_seed(seed: int) -> int:
    """A seed as the int64 with the same low 64 bits (the sampler hashes 64 bits of it)."""
    seed %= 1 << 64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _settings(request: _Request) -> tuple[float, int, float]:
    return request.params.temperature, request.params.top_k, request.params.top_p


def _truncates(requests: list[_Request], vocab: int) -> bool:
    """Whether some request draws from a truncated distribution (top_k or top_p on)."""
    return any(0 < r.params.top_k < vocab or r.params.top_p < 1 for r in requests)


def _check_fits(
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    max_running: int,
    max_len: int,
    device: torch.device,
    dtype: torch.dtype,
    adapted: Sequence[str] = (),
) -> None:
    """SchemaError, before anything is allocated, if the weights (and the base weights that adapters merged
    into them keep aside, `adapted`) and a KV cache of max_running requests of max_len tokens cannot fit
    what `device` has free (the cache is allocated whole, at start)."""
    free = free_bytes(device)
    cache = KVCache.nbytes(config, max_running, max_len, dtype)
    weights = sum(t.numel() for t in [*tensors.values(), *(tensors[name] for name in adapted)]) * dtype.itemsize
    if free is not None and cache + weights > free:
        gib = 1 << 30
        raise SchemaError(
            f"TorchEngine max_running x max_len: a KV cache of {max_running} requests of {max_len} tokens takes "
            f"{cache / gib:.1f} GiB, the weights {weights / gib:.1f} GiB, and {device} has {free / gib:.1f} GiB "
            "free; expected fewer requests or tokens (a recipe's sampling.max_in_flight, sampling.context_length)"
        )


class _Scheduler:
    """The worker thread's state: model, cache, requests. Only the worker thread touches it.

    What each slot decodes next lives on the device (SlotState) and each step advances it there, so a
    decode step sends nothing to the device but the state of slots that changed hands, and its sampled
    tokens (with a mixture's expert ids) come back in one read: the only wait on the device per step.
    On CUDA, each decode shape (decode_shape, and whether some row truncates its distribution) is
    captured once as a CUDA graph of the whole step (forward, logits, sampling, advance; the forward
    only where top-k/top-p sort) and replayed; a release drops the graphs with the cache and state they
    point into."""

    def __init__(
        self,
        model: DecoderModel,
        config: ModelConfig,
        max_running: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        version: int,
        compile: bool = False,
    ):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.decode, self.sample = model.decode, sampling.sample
        self.compile_failures: list[str] = []
        if compile:  # a mixture's routing breaks the decode's graph: it reads expert ids on the host
            self.decode = _CompiledOrEager(model.decode, self.compile_failures)
            self.sample = _CompiledOrEager(sampling.sample, self.compile_failures)
        self.max_running, self.max_len = max_running, max_len
        self.version = version
        self.base: str | None = None  # the checksum of the LoRA base held (Adapter.base), if any
        self.graphs = device.type == "cuda" and not config.moe  # routing reads expert ids on the host
        self.graph_failure: str | None = None  # why decode runs eagerly on CUDA, if capture failed
        self.waiting: deque[_Request] = deque()
        self.running: dict[int, _Request] = {}  # slot -> request
        self.free_slots = list(range(max_running))  # a heap: the lowest slot first keeps decode batches small
        self.held: list[_Call] = []
        self.paused = self.released = self.closed = False
        self._allocate()

    def _allocate(self) -> None:
        """What a release gives back: the KV cache, the slots' decode state, the decode graphs."""
        self.cache: KVCache | None = KVCache(self.config, self.max_running, self.max_len, self.device, self.dtype)
        self.slots: SlotState | None = SlotState(self.max_running, self.config.vocab_size, self.device)
        # (batch, span, truncated) -> a decode step's graph and its outputs (_decode_step)
        self.captured: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None

    def busy(self) -> bool:
        return not (self.paused or self.released) and bool(self.waiting or self.running)

    def apply(self, command: _Request | _Call) -> None:
        if not command.done.set_running_or_notify_cancel():
            return  # the caller gave up before the worker saw it
        if isinstance(command, _Request):
            if self.config.moe:
                command.routing = RoutingLog(self.config.num_hidden_layers, self.config.num_experts_per_tok)
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
        """Admit what fits once enough slots are free (their prompts prefilled together, up to
        PREFILL_TOKENS padded tokens per forward), then one decode step for every running request."""
        enough = min(len(self.waiting), max(1, self.max_running // ADMISSION_SHARE))
        admitted = self._admit() if self.waiting and len(self.free_slots) >= enough else []
        for chunk in _prefill_chunks(admitted, lambda r: len(r.prompt)):
            self._prefill(chunk)
        if self.running:
            self._decode()

    def _admit(self) -> list[_Request]:
        """Waiting requests into the lowest free slots, in order, while slots are free."""
        admitted: list[_Request] = []
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            if request.params.max_new_tokens == 0:
                self._finish(request, FINISH_LENGTH)
                continue
            request.slot = heapq.heappop(self.free_slots)
            seed = request.params.seed
            request.seed = _int64_seed(secrets.randbits(63) if seed is None else seed)
            self.running[request.slot] = request
            admitted.append(request)
        return admitted

    def _prefill(self, requests: list[_Request]) -> None:
        """Prefill the admitted prompts in one forward and draw each one's first token: for its slot's
        state, the step that feeds the prompt's last token at its last position. A prompt admitted several
        times at once (a GRPO group's) is computed once; the others' slots get a copy of its keys and
        values, and each draws its own first token from the same logits."""
        for r in requests:
            self.slots.hold(r.slot, r.prompt[-1], len(r.prompt) - 1, r.seed, 0, _settings(r))
        self.slots.flush()
        computed: list[_Request] = []  # the first request of each distinct prompt, whose prefill is computed
        rows: dict[tuple[int, ...], int] = {}  # a prompt's row among them
        row_of = []  # each request's
        for request in requests:
            row_of.append(rows.setdefault(tuple(request.prompt), len(computed)))
            if row_of[-1] == len(computed):
                computed.append(request)
        prompts = [torch.tensor(r.prompt, device=self.device) for r in computed]
        logits, routing = self.model.prefill(prompts, self.cache, [r.slot for r in computed])
        if len(computed) < len(requests):
            copies = [(computed[row], r) for r, row in zip(requests, row_of, strict=True) if computed[row] is not r]
            width = max(len(r.prompt) for r in computed)
            self.cache.copy_slots([source.slot for source, _ in copies], [r.slot for _, r in copies], width)
            index = torch.tensor(row_of, device=HOST).to(self.device, non_blocking=True)
            logits, routing = logits[index], None if routing is None else routing[index]
        for request in requests:
            request.cached = len(request.prompt)
        slots = torch.tensor([r.slot for r in requests], device=HOST).to(self.device, non_blocking=True)
        chosen, logprobs = self.sample(logits, self.slots.rows(slots, _truncates(requests, self.config.vocab_size)))
        self.slots.advance(slots, chosen)
        self._emit(requests, list(range(len(requests))), chosen, logprobs, routing)

    def _refill(self, requests: list[_Request]) -> None:
        """Recompute running requests' caches (dropped by `release`); each one's last token is fed next step."""
        sequences = [(r.prompt + r.output)[:-1] for r in requests]
        tensors = [torch.tensor(s, device=self.device) for s in sequences]
        self.model.prefill(tensors, self.cache, [r.slot for r in requests])
        for request, sequence in zip(requests, sequences, strict=True):
            request.cached = len(sequence)
            self.slots.hold(
                request.slot, request.output[-1], request.cached, request.seed, len(request.output), _settings(request)
            )

    def _decode(self) -> None:
        requests = [self.running[slot] for slot in sorted(self.running)]
        slots = [r.slot for r in requests]
        batch, span = decode_shape(slots, [r.cached for r in requests], self.max_running, self.max_len)
        self.slots.flush()
        rows, outputs = self._decode_step(batch, span, _truncates(requests, self.config.vocab_size), slots)
        for request in requests:
            request.cached += 1
        self._emit(requests, rows, *outputs)

    def _decode_step(self, batch: int, span: int, truncated: bool, held: list[int]) -> tuple[list[int], tuple]:
        """A decode step over slots 0..batch-1, of which `held` (ascending) are running: where each held
        slot's draw lies in the outputs, and the outputs: drawn tokens and their logprobs, and a
        mixture's expert ids [rows, layers, top_k] (None if dense).

        On CUDA a replayed graph, captured the first time this shape runs (dense models only); it draws
        for every slot, idle ones included, so its shapes stay fixed. A step that truncates some row's
        distribution replays only its forward: top-k/top-p sort the logits, and CUB's segmented sort is
        not capturable at every shape. Eagerly (elsewhere, or if capture failed), only the held slots
        get logits and draws."""
        if not self.graphs:
            rows = torch.tensor(held, device=HOST).to(self.device, non_blocking=True)
            return list(range(len(held))), self._step(batch, span, truncated, rows)
        every = slice(0, batch)
        key = (batch, span, truncated)
        if key in self.captured:
            graph, outputs = self.captured[key]
            graph.replay()
            if truncated:
                hidden, routing = outputs
                return held, (*self._draw(every, hidden, truncated), routing)
            return held, outputs
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # this step, for real: cuBLAS and kernel selection happen outside capture
            outputs = self._step(batch, span, truncated, every)
        current.wait_stream(side)
        try:
            self.captured[key] = self._capture(
                partial(self._forward, batch, span) if truncated else partial(self._step, batch, span, False, every)
            )
        except RuntimeError as e:
            self.graphs, self.graph_failure = False, f"CUDA graph capture failed, decoding eagerly: {e!r}"
            self.captured.clear()
            log.warning(self.graph_failure)
        return held, outputs

    def _step(self, batch: int, span: int, truncated: bool, rows: Slots) -> tuple:
        """Forward over slots 0..batch-1 (idle ones compute at position 0, unread), then draws for the
        slots `rows`, which advance past them."""
        hidden, routing = self._forward(batch, span)
        routing = None if routing is None else take(routing, 0, rows)
        return *self._draw(rows, take(hidden, 0, rows), truncated), routing

    def _forward(self, batch: int, span: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final-norm hidden states [batch, hidden] of slots 0..batch-1 and a mixture's expert ids."""
        tokens, positions = self.slots.inputs(batch)
        return self.decode(tokens, positions, self.cache, span)

    def _draw(self, rows: Slots, hidden: torch.Tensor, truncated: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The token and logprob of each slot of `rows` (whose hidden states `hidden` are), drawn from its
        logits; the slots advance past them."""
        chosen, logprobs = self.sample(self.model.logits(hidden), self.slots.rows(rows, truncated))
        self.slots.advance(rows, chosen)
        return chosen, logprobs

    def _capture(self, step: Callable[[], tuple]) -> tuple:
        """A CUDA graph of `step` (reading and writing the cache and the slots' state where they are) and
        its outputs. Capturing runs nothing: what it records runs at each replay."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = step()
        return graph, outputs

    def _emit(
        self,
        requests: list[_Request],
        rows: list[int],
        chosen: torch.Tensor,
        logprobs: torch.Tensor,
        routing: torch.Tensor | None,
    ) -> None:
        """Give each request the token drawn in its row of `chosen` (and its logprob; `routing` [rows,
        layers, top_k] holds the experts a mixture chose, None if dense). Tokens, logprobs and expert ids
        come to the host in one copy, the step's one wait on the device."""
        columns = [chosen.double()[:, None], logprobs.double()[:, None]]
        if routing is not None:  # expert ids are small integers: exact in float64
            columns.append(routing.flatten(1).double())
        host = torch.cat(columns, dim=1).to(HOST)[rows]
        tokens, values = host[:, 0].tolist(), host[:, 1].tolist()
        experts = (
            host[:, 2:].to(EXPERT_ID_DTYPE).view(len(requests), *routing.shape[1:]) if routing is not None else None
        )
        for i, (request, token, logprob) in enumerate(zip(requests, tokens, values, strict=True)):
            token = int(token)
            request.output.append(token)
            request.logprobs.append(logprob)
            request.versions.append(self.version)
            if experts is not None:
                request.routing.append(experts[i])
            if token in request.stop_ids:
                self._finish(request, FINISH_STOP)
            elif len(request.output) >= request.params.max_new_tokens:
                self._finish(request, FINISH_LENGTH)

    def _finish(self, request: _Request, reason: str) -> None:
        if self.running.get(request.slot) is request:
            del self.running[request.slot]
            heapq.heappush(self.free_slots, request.slot)
            if self.slots is not None:  # else released: onload starts from a fresh state
                self.slots.free(request.slot)
        routed = request.routing.tensor() if request.routing is not None else None
        result = Generation(
            request.request_id, request.output, request.logprobs, request.versions, reason, len(request.prompt), routed
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

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor], adapter: Adapter | None) -> None:
        """A version's weights, in place (the decode graphs keep reading the same parameters): a whole model
        drops any adapters; a LoRA version's adapters apply onto the base it carries, or else onto the one
        held, which must be the base they were trained on (CorruptWeights otherwise)."""
        base, adapters = split_version(tensors) if adapter is not None else (tensors, {})
        if adapter is not None and not base and adapter.base != self.base:
            held = f"the base {self.base}" if self.base else "no LoRA base (its weights are a whole version's)"
            raise CorruptWeights(
                f"weights v{version}: adapters on the base {adapter.base}, but the engine holds {held}; expected "
                "a version that carries its base"
            )
        self.model.check_adapters(adapters)
        if base or adapter is None:
            self.model.load_weights(base)
            self.base = None if adapter is None else adapter.base
        self.model.set_adapters(adapters, adapter.scale if adapter is not None else 1.0)
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
        """Give the device's memory back: cache, inputs and graphs dropped, weights to host memory."""
        if self.released:
            return
        self.released = True
        self.cache = self.slots = self.pool = None
        self.captured.clear()
        if self.device.type != "cpu":
            self.model.to(HOST)
        free_cached(self.device)

    def onload(self) -> None:
        if not self.released:
            return
        self.model.to(self.device)
        self._allocate()
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

    compile: the decode step and the sampler go through torch.compile, a few fused kernels per layer and
    per draw instead of dozens; on CUDA the compiled decode is what the decode graphs replay. Prefill
    stays eager: its shapes change with every admission (batch and prompt length), each new one a
    recompilation of the whole model, and its large matrix products gain little. Each kind of step
    compiles on its first use (seconds to a minute); if compiling fails, the engine runs eagerly and
    `compile_failures` says why.

    `source` is a ModelSource; `version` is its weights version (by default a Published's own, else 0).
    A LoRA version (meshy.dataplane.adapters: a Published's own Adapter, or `adapter` for a (config,
    tensors) pair) must carry its base; its adapters, and those of later versions on that base, are merged
    into the weights (DecoderModel.set_adapters), which keep the adapted base weights aside.
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
        compile: bool = False,
        adapter: Adapter | None = None,
    ):
        if max_running < 1:
            raise SchemaError(f"TorchEngine max_running: expected >= 1, got {max_running}")
        if max_len < 2:
            raise SchemaError(f"TorchEngine max_len: expected >= 2 tokens, got {max_len}")
        if dtype not in DTYPES:
            raise SchemaError(f"TorchEngine dtype: expected one of {list(DTYPES)}, got {dtype!r}")
        adapter = _adapter_of(source, adapter)
        config, tensors = read_model(source)
        self.config = ModelConfig.from_hf(config)
        self.vocab_size, self.max_len = self.config.vocab_size, max_len
        if version is None:
            version = source.version if isinstance(source, Published) else 0
        device = torch.device(device)
        base, adapters = split_version(tensors) if adapter is not None else (tensors, {})
        if adapter is not None and not base:
            raise SchemaError("TorchEngine source: a LoRA version without its base; expected one that carries it")
        _check_fits(self.config, base, max_running, max_len, device, DTYPES[dtype], [n for n in adapters if n in base])
        model = load_model(self.config, base, device, DTYPES[dtype])
        if adapter is not None:
            model.set_adapters(adapters, adapter.scale)
        self._scheduler = _Scheduler(model, self.config, max_running, max_len, device, DTYPES[dtype], version, compile)
        self._scheduler.base = None if adapter is None else adapter.base
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

    @property
    def records_routing(self) -> bool:
        return self.config.moe

    @property
    def lora_base(self) -> str | None:
        return self._scheduler.base

    @property
    def cuda_graphs(self) -> dict:
        """How decode runs: the (batch, span) shapes captured as CUDA graphs so far, and why decoding is
        eager if capture failed (None otherwise)."""
        return {"shapes": sorted(self._scheduler.captured), "failure": self._scheduler.graph_failure}

    @property
    def compile_failures(self) -> list[str]:
        """Why parts of a compile=True engine run eagerly (empty: everything compiled, or compile=False)."""
        return list(self._scheduler.compile_failures)

    # ---- the public coroutines ----

    async def _generate(self, request_id: str, input_ids: list[int], params: SamplingParams) -> Generation:
        with self._lock:
            if request_id in self._active:
                raise SchemaError(f"request_id {request_id!r}: a request with this id is already running")
            self._active.add(request_id)
        stop_ids = frozenset(self.config.eos_token_ids) | frozenset(params.stop_token_ids)
        request = _Request(request_id, input_ids, params, stop_ids, Future())
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

    async def _score(self, input_ids: list[int], top_k: int, start: int) -> Scores:
        return await self._call(partial(self._scheduler.score, input_ids, top_k, start), needs_device=True)

    async def abort(self, request_id: str) -> None:
        await self._call(partial(self._scheduler.abort, request_id))

    async def pause(self) -> None:
        await self._call(partial(self._scheduler.set_paused, True))

    async def resume(self) -> None:
        await self._call(partial(self._scheduler.set_paused, False))

    async def update_weights(self, version: int, source: WeightsSource, adapter: Adapter | None = None) -> None:
        """A Published is read and verified off the worker (generation goes on meanwhile): a LoRA version's
        base only if the engine does not hold it already. A corrupt or mismatched version raises and leaves
        the engine on its current weights."""
        adapter = _adapter_of(source, adapter)
        if isinstance(source, Published):
            if source.version != version:
                raise SchemaError(f"update_weights version: {version} given for published version {source.version}")
            config, source = await asyncio.to_thread(read_published, source, held_base=self.lora_base)
            if ModelConfig.from_hf(config) != self.config:
                raise SchemaError(f"weights v{version}: config.json describes another model than the engine's")
        await self._call(partial(self._scheduler.load_weights, version, source, adapter))

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
