"""What the teacher and reference services share: they score every response with a fixed model.

A scoring service leases rows whose prompt_ids and response_ids are ready, scores a lease's rows
concurrently (an engine that batches, like SGLang, scores them at once) at every response position,
and writes its columns for them in the same call that acks the lease. A row it cannot score (an empty
prompt or response, or one longer than the model's context) gets empty columns, which the trainer
drops with a reason, so no group ever waits forever.
"""

import abc
import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshy.dataplane import Bursts, DataPlaneClient, SchemaError
from meshy.dataplane import columns as cols
from meshy.dataplane.bursts import check_burst_fields
from meshy.dataplane.fields import check_fields
from meshy.infer.engine import Engine, Scores

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoringConfig:
    """task/table: under which task, from which table, rows are leased (the task sees every row once).
    rows_per_lease: the most rows leased, and scored concurrently, at a time. burst_rows, burst_wait_s:
    a lease waits for burst_rows ready rows, for up to burst_wait_s after the last one (a colocated
    scorer takes the devices for each lease: meshy.dataplane.bursts); by default it takes any."""

    task: str
    table: str = "rollout"
    rows_per_lease: int = 8
    burst_rows: int = 1
    burst_wait_s: float = 0.0
    lease_s: float = 600.0
    poll_s: float = 0.2

    def __post_init__(self) -> None:
        check_fields(self)
        if self.rows_per_lease < 1:
            raise SchemaError(f"{type(self).__name__}.rows_per_lease: expected >= 1, got {self.rows_per_lease}")
        check_burst_fields(self, "rows_per_lease")


class ScoringService(abc.ABC):
    """Subclasses say which task they serve (its declaration: the columns it reads and writes), how
    many top-k ids per position they need, and what they write for a row's scores (and for a row that
    cannot be scored). device_turn: what scoring a lease runs inside: a colocated engine's turn on its
    ring's devices (meshy.recipes.roles.colocation), nothing otherwise."""

    declared: cols.Task

    def __init__(
        self,
        client: DataPlaneClient,
        engine: Engine,
        config: ScoringConfig,
        device_turn: Callable[[], contextlib.AbstractAsyncContextManager] = contextlib.nullcontext,
    ):
        self.client = client
        self.engine = engine
        self.config = config
        self.device_turn = device_turn
        self.rows = 0
        self.unscored = 0

    @property
    def top_k(self) -> int:
        return 0

    @abc.abstractmethod
    def row_columns(self, scores: Scores) -> tuple[torch.Tensor, ...]:
        """This service's columns for one row, from the engine's scores of its response positions."""

    @abc.abstractmethod
    def empty_columns(self) -> tuple[torch.Tensor, ...]:
        """This service's columns for a row it cannot score: no entries for any response token."""

    async def run(self, stop: asyncio.Event | None = None, max_rows: int | None = None) -> int:
        cfg = self.config
        stop = stop or asyncio.Event()
        bursts = Bursts(cfg.burst_rows, cfg.burst_wait_s)
        while not stop.is_set() and (max_rows is None or self.rows < max_rows):
            batch = await asyncio.to_thread(
                self.client.lease,
                cfg.table,
                cfg.task,
                list(self.declared.reads),
                count=cfg.rows_per_lease,
                min_count=bursts.min_count(),
                lease_s=cfg.lease_s,
                timeout=cfg.poll_s,
            )
            if batch is None:
                continue
            bursts.leased()
            async with self.device_turn():
                scored = await asyncio.gather(  # in flight together: an engine that batches scores them at once
                    *(
                        self._score(prompt, response)
                        for prompt, response in zip(
                            batch.columns[cols.PROMPT_IDS], batch.columns[cols.RESPONSE_IDS], strict=True
                        )
                    )
                )
            columns = {name: [row[i] for row in scored] for i, name in enumerate(self.declared.writes)}
            await asyncio.to_thread(self.client.add_columns, cfg.table, batch.row_ids, columns, ack=batch)
            self.rows += len(batch)
        return self.rows

    async def _score(self, prompt: torch.Tensor, response: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(response) == 0 or len(prompt) == 0:
            return self.empty_columns()
        try:
            scores = await self.engine.score(
                torch.cat([prompt, response]).tolist(), top_k=self.top_k, start=len(prompt) - 1
            )
        except SchemaError as e:
            log.warning("%s cannot score a row (%s); it gets empty columns", self.config.task, e)
            self.unscored += 1
            return self.empty_columns()
        return self.row_columns(scores)
