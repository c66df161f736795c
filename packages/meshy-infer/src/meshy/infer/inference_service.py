"""The inference service: turns rows whose `prompt_ids` are ready into responses, keeping the engine busy.

It leases prompts up to `max_in_flight` requests, and for each finished one writes response_ids,
rollout_logprobs, token_versions, finish_reason and truncated while acking the prompt, in one atomic
write. When the `weights` stream announces a newer version it pauses the engine, loads the version and
resumes; requests in flight either go on in place or are aborted and continue from their prefix under
the new weights (`update_mode`). Either way token_versions record which version produced each token.

A row that cannot be generated (empty prompt, prompt longer than the context, token id outside the
vocabulary) gets its reason in the `error` column and an empty response, and the service keeps going.
"""

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from meshy.dataplane import Batch, DataPlaneClient, SchemaError
from meshy.dataplane import rollout as cols
from meshy.dataplane.fields import check_fields
from meshy.dataplane.weights import WEIGHTS_STREAM, CorruptWeights, Published
from meshy.infer.engine import FINISH_ABORT, FINISH_LENGTH, Engine, SamplingParams

log = logging.getLogger(__name__)
FINISH_ERROR = "error"


@dataclass(frozen=True)
class InferenceServiceConfig:
    """context_length: prompt + response budget of the engine; a longer prompt is an error row, and
    max_new_tokens shrinks to fit. seed: per-row seeds derived from it (None: unseeded sampling).
    update_mode: how a new weights version meets requests in flight. "in_place": they keep their cache
    and go on under the new weights from the next token (cheap; what an engine that updates between
    decode steps allows). "abort": they are aborted and continue from their prefix, recomputed under the
    new weights (an exact version boundary; what engines without in-place updates need)."""

    table: str = "rollout"
    task: str = "generate"
    max_in_flight: int = 32
    max_new_tokens: int = 256
    context_length: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    update_mode: Literal["in_place", "abort"] = "in_place"
    lease_s: float = 600.0
    poll_s: float = 0.2
    weights_stream: str = WEIGHTS_STREAM

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_in_flight < 1 or self.max_new_tokens < 1 or self.context_length < 2:
            raise SchemaError(
                f"InferenceServiceConfig: max_in_flight, max_new_tokens >= 1, context_length >= 2: {self}"
            )

    def sampling(self, row_id: int, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=None if self.seed is None else (self.seed * 1_000_003 + row_id) % (1 << 63),
            stop_token_ids=self.stop_token_ids,
        )


@dataclass
class InferenceStats:
    rows: int = 0
    errors: int = 0
    tokens: int = 0
    weight_updates: int = 0
    continued: int = 0  # requests aborted by a weight update and continued from their prefix
    busy_s: float = 0.0  # wall time with at least one request in flight
    failed_loads: int = 0  # announced versions that could not be loaded (corrupt, or already pruned)
    versions: list[int] = field(default_factory=list)


class InferenceService:
    def __init__(self, client: DataPlaneClient, engine: Engine, config: InferenceServiceConfig):
        self.client = client
        self.engine = engine
        self.config = config
        self.stats = InferenceStats()
        self._in_flight: dict[int, asyncio.Task] = {}  # row id -> its task
        self._requests: dict[int, str] = {}  # row id -> its current engine request
        self._aborted_for_update: set[str] = set()
        self._updating = asyncio.Event()
        self._updating.set()  # set: no update in progress
        # Finished rows wait here, by lease, to be written (and acked) many at a time.
        self._finished: dict[int, tuple[Batch, list[int], list[dict]]] = {}
        self._finished_ready = asyncio.Event()
        self._busy_since = 0.0

    async def run(self, stop: asyncio.Event | None = None, max_rows: int | None = None) -> InferenceStats:
        """Serve until `stop` is set (or `max_rows` rows are written); then finish what is in flight."""
        stop = stop or asyncio.Event()
        watcher = asyncio.create_task(self._watch_weights(stop))
        writer = asyncio.create_task(self._write_finished())
        try:
            while not stop.is_set() and (max_rows is None or self.stats.rows < max_rows):
                for helper in (watcher, writer):  # a helper that died takes the service down, loudly
                    if helper.done():
                        helper.result()
                free = self.config.max_in_flight - len(self._in_flight)
                if free <= 0:
                    await asyncio.wait(list(self._in_flight.values()), return_when=asyncio.FIRST_COMPLETED)
                    continue
                batch = await asyncio.to_thread(
                    self.client.lease,
                    self.config.table,
                    self.config.task,
                    [cols.PROMPT_IDS],
                    count=free,
                    min_count=1,
                    lease_s=self.config.lease_s,
                    timeout=self.config.poll_s,
                )
                if batch is None:
                    await asyncio.sleep(0)
                    continue
                if not self._in_flight:
                    self._busy_since = time.monotonic()
                for i, row_id in enumerate(batch.row_ids):
                    task = asyncio.create_task(self._serve(batch, row_id, batch.columns[cols.PROMPT_IDS][i]))
                    self._in_flight[row_id] = task
                    task.add_done_callback(lambda _, row=row_id: self._finish(row))
            if self._in_flight:
                await asyncio.gather(*self._in_flight.values())
        finally:
            stop.set()
            writer.cancel()
            await watcher
        await self._flush()
        return self.stats

    def _finish(self, row_id: int) -> None:
        self._in_flight.pop(row_id, None)
        if not self._in_flight:
            self.stats.busy_s += time.monotonic() - self._busy_since

    async def _serve(self, batch: Batch, row_id: int, prompt: torch.Tensor) -> None:
        try:
            columns = await self._generate(row_id, prompt.tolist())
        except SchemaError as e:
            columns = self._error_columns(str(e))
        except Exception as e:  # the row is reported, the service goes on
            log.exception("row %s failed", row_id)
            columns = self._error_columns(f"{type(e).__name__}: {e}")
        _, rows, values = self._finished.setdefault(batch.lease_id, (batch, [], []))
        rows.append(row_id)
        values.append(columns)
        self._finished_ready.set()

    async def _write_finished(self) -> None:
        while True:
            await self._finished_ready.wait()
            self._finished_ready.clear()
            await self._flush()

    async def _flush(self) -> None:
        """Write every finished row, one atomic write-and-ack per lease."""
        finished, self._finished = self._finished, {}
        for batch, rows, values in finished.values():
            columns = {name: [v[name] for v in values] for name in values[0]}
            columns[cols.TRUNCATED] = torch.tensor(columns[cols.TRUNCATED])
            await asyncio.to_thread(self.client.add_columns, self.config.table, rows, columns, ack=batch)
            self.stats.rows += len(rows)
            self.stats.errors += sum(v[cols.FINISH_REASON] == FINISH_ERROR for v in values)

    async def _generate(self, row_id: int, prompt: list[int]) -> dict:
        cfg = self.config
        if not prompt:
            raise SchemaError("prompt_ids is empty")
        if len(prompt) >= cfg.context_length:
            raise SchemaError(f"prompt of {len(prompt)} tokens does not fit the context of {cfg.context_length}")
        budget = min(cfg.max_new_tokens, cfg.context_length - len(prompt))
        output, logprobs, versions, attempt = [], [], [], 0
        try:
            while True:
                await self._updating.wait()
                request_id = self._requests[row_id] = f"{cfg.table}/{row_id}/{attempt}"
                params = cfg.sampling(row_id, budget - len(output))
                if attempt and params.seed is not None:
                    params = replace(params, seed=params.seed + attempt)
                result = await self.engine.generate(request_id, prompt + output, params)
                output += result.output_ids
                logprobs += result.logprobs
                versions += result.token_versions
                aborted_for_update = request_id in self._aborted_for_update and result.finish_reason == FINISH_ABORT
                self._aborted_for_update.discard(request_id)
                if not aborted_for_update:
                    finish = result.finish_reason
                elif len(output) < budget:  # continue from the prefix, under the new weights
                    attempt += 1
                    self.stats.continued += 1
                    continue
                else:
                    finish = FINISH_LENGTH
                break
        finally:
            self._requests.pop(row_id, None)
        self.stats.tokens += len(output)
        return {
            cols.RESPONSE_IDS: torch.tensor(output, dtype=torch.int64),
            cols.ROLLOUT_LOGPROBS: torch.tensor(logprobs, dtype=torch.float32),
            cols.TOKEN_VERSIONS: torch.tensor(versions, dtype=torch.int64),
            cols.FINISH_REASON: finish,
            cols.TRUNCATED: finish == FINISH_LENGTH,
            cols.ERROR: "",
        }

    @staticmethod
    def _error_columns(reason: str) -> dict:
        empty = torch.zeros(0, dtype=torch.int64)
        return {
            cols.RESPONSE_IDS: empty,
            cols.ROLLOUT_LOGPROBS: torch.zeros(0),
            cols.TOKEN_VERSIONS: empty,
            cols.FINISH_REASON: FINISH_ERROR,
            cols.TRUNCATED: False,
            cols.ERROR: reason,
        }

    async def _watch_weights(self, stop: asyncio.Event) -> None:
        reader = self.client.reader(self.config.weights_stream, f"inference-{self.client.consumer_id}", "latest")
        while not stop.is_set():
            messages = await asyncio.to_thread(reader.read, 64, self.config.poll_s)
            newest = max((Published.from_message(m.payload) for m in messages), key=lambda p: p.version, default=None)
            if newest is not None and newest.version > self.engine.weight_version:
                try:
                    await self._load(newest)
                except CorruptWeights as e:  # e.g. pruned because newer versions followed: wait for the next one
                    log.warning(
                        "weights v%d not loaded (%s); generation goes on with v%d",
                        newest.version,
                        e,
                        self.engine.weight_version,
                    )
                    self.stats.failed_loads += 1
        await asyncio.to_thread(reader.close)

    async def _load(self, published: Published) -> None:
        """Pause, abort what is in flight (it continues from its prefix), load, resume."""
        self._updating.clear()
        try:
            await self.engine.pause()
            if self.config.update_mode == "abort":
                for request_id in list(self._requests.values()):
                    self._aborted_for_update.add(request_id)
                    await self.engine.abort(request_id)
            await self.engine.update_weights(published.version, published)
            self.stats.weight_updates += 1
            self.stats.versions.append(published.version)
        finally:
            self._updating.set()
            await self.engine.resume()
