"""The interface every generation backend implements, so services and tests do not care which one runs.

All methods are coroutines. A generation reports, for every output token, the log-probability of the
sampled token under the distribution it was sampled from (temperature applied, before top-k/top-p
truncation, as the trainer computes it) and the weights version that produced it. Weight updates land
between decode steps; tokens already produced keep their version.
"""

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from meshy.dataplane import SchemaError
from meshy.dataplane.adapters import Adapter
from meshy.dataplane.fields import check_fields
from meshy.dataplane.weights import Published

FINISH_STOP = "stop"  # an EOS or stop token was produced (it is part of the output)
FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_ABORT = "abort"  # aborted: the output so far is returned


@dataclass(frozen=True)
class SamplingParams:
    """How a response is generated: the one declaration of the sampling settings, checked here, which the
    services and the recipe pass on. max_new_tokens: output budget. temperature 0 is greedy. top_k 0 and
    top_p 1 disable truncation. seed: same seed, same prompt, same weights -> same tokens. stop_token_ids
    end a generation (EOS is the engine's own and always stops)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_new_tokens < 0:
            raise SchemaError(f"SamplingParams.max_new_tokens: expected >= 0, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise SchemaError(
                f"SamplingParams.temperature: expected a finite value >= 0 (0: greedy), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise SchemaError(f"SamplingParams.top_p: expected in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SchemaError(f"SamplingParams.top_k: expected >= 0 (0 is off), got {self.top_k}")


@dataclass
class Generation:
    """routed_experts: for an engine that records routing (`Engine.records_routing`), the experts every
    MoE layer chose for each output token [len(output_ids), layers, top_k] int16 on the host (entry i:
    the routing of the forward whose logits gave token i; meshy.infer.routing_log); None otherwise."""

    request_id: str
    output_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    finish_reason: str
    prompt_length: int = 0
    routed_experts: torch.Tensor | None = None


@dataclass
class Scores:
    """Per position t >= start of a scored sequence: log p(ids[t + 1] | ids[:t + 1]) and the top-k."""

    token_logprobs: list[float]
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)


WeightsSource = Published | Mapping[str, torch.Tensor]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class EngineClosed(RuntimeError):
    """The engine was closed (or its worker failed) before the call could run."""


class Engine(abc.ABC):
    """A generation backend. `weight_version` is the version the next token will be produced by.
    `vocab_size` and `max_len` (the most tokens of prompt + output) bound every input: `generate` and
    `score` check theirs here, for every engine, before the engine's `_generate` / `_score` sees them.
    `records_routing`: every Generation carries routed_experts (a mixture-of-experts model on an engine
    that records its routing). `lora_base`: the checksum of the LoRA base the engine holds (Adapter.base of
    the last version that carried one; None after a whole version). `switches_adapters_live`: the engine loads a
    LoRA version's adapters while it generates and moves its requests onto them itself, each token keeping its
    adapter's version (SGLangEngine with LoRA), so whoever updates it need not hold generation for them."""

    weight_version: int
    vocab_size: int
    max_len: int
    records_routing: bool = False
    lora_base: str | None = None
    switches_adapters_live: bool = False

    async def generate(self, request_id: str, input_ids: list[int], params: SamplingParams) -> Generation:
        """Generate a continuation; returns when it finishes (stop, length or abort)."""
        if not isinstance(request_id, str):
            raise SchemaError(f"request_id: expected a str, got {type(request_id).__name__} {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise SchemaError(f"params: expected SamplingParams, got {type(params).__name__}")
        self._check_ids("input_ids", input_ids)
        self._check_ids("params.stop_token_ids", params.stop_token_ids, may_be_empty=True)
        total = len(input_ids) + params.max_new_tokens
        if total > self.max_len:
            raise SchemaError(
                f"input_ids + params.max_new_tokens: {len(input_ids)} + {params.max_new_tokens} = {total} tokens, "
                f"beyond the engine's max_len of {self.max_len}"
            )
        return await self._generate(request_id, list(input_ids), params)

    async def score(self, input_ids: list[int], top_k: int = 0, start: int = 0) -> Scores:
        """Log-probabilities of a given sequence from position `start` on (and the top-k at each)."""
        self._check_ids("input_ids", input_ids)
        if len(input_ids) > self.max_len:
            raise SchemaError(
                f"score input_ids: {len(input_ids)} tokens, beyond the engine's max_len of {self.max_len}"
            )
        if not _is_int(top_k) or not 0 <= top_k <= self.vocab_size:
            raise SchemaError(f"score top_k: expected 0..{self.vocab_size}, got {top_k!r}")
        if not _is_int(start) or not 0 <= start < len(input_ids):
            raise SchemaError(f"score start: expected a position in 0..{len(input_ids) - 1}, got {start!r}")
        return await self._score(list(input_ids), top_k, start)

    @abc.abstractmethod
    async def _generate(self, request_id: str, input_ids: list[int], params: SamplingParams) -> Generation:
        """`generate`, its input checked."""

    @abc.abstractmethod
    async def _score(self, input_ids: list[int], top_k: int, start: int) -> Scores:
        """`score`, its input checked."""

    def _check_ids(self, name: str, ids: Sequence[int], may_be_empty: bool = False) -> None:
        if not isinstance(ids, list | tuple):
            raise SchemaError(f"{name}: expected a list of token ids, got {type(ids).__name__}")
        if not ids and not may_be_empty:
            raise SchemaError(f"{name}: empty; expected at least one token id")
        for i, token in enumerate(ids):
            if not _is_int(token) or not 0 <= token < self.vocab_size:
                raise SchemaError(
                    f"{name}[{i}]: expected a token id in the vocabulary [0, {self.vocab_size}), got {token!r}"
                )

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """End a running generation now; its `generate` returns the output so far (finish "abort")."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop producing tokens after the current step; running requests keep their state."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue after `pause`."""

    @abc.abstractmethod
    async def update_weights(self, version: int, source: WeightsSource, adapter: Adapter | None = None) -> None:
        """Load a published version (verified) or in-memory HF-named tensors between decode steps.

        A LoRA version (meshy.dataplane.adapters) has an Adapter: a Published's own, else `adapter`, the
        announcement's for tensors received on the weight-sync group. Its adapters apply onto the base the
        version carries, which replaces the engine's, or else onto the base the engine holds (`lora_base`);
        adapters on a base the engine does not hold raise CorruptWeights naming both, and the engine goes on
        with what it had. A whole version (no Adapter) drops any adapters."""

    @abc.abstractmethod
    async def release(self) -> None:
        """Free device memory (weights and cache) for a colocated role; generation waits for `onload`."""

    @abc.abstractmethod
    async def onload(self) -> None:
        """Take device memory back after `release`."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop the engine; pending generations end as aborted."""
