"""The teacher service: scores responses with a fixed teacher model for online policy distillation.

For each row whose prompt_ids and response_ids are ready it writes the teacher's top-k token ids and
log-probabilities at every response position ([L, k] each). A row it cannot score (for example longer
than the teacher's context) gets empty [0, k] columns, which the trainer drops with a reason, so no
group ever waits forever.
"""

import asyncio
import logging
from dataclasses import dataclass

import torch

from meshy.dataplane import HOST, DataPlaneClient, SchemaError
from meshy.dataplane import rollout as cols
from meshy.dataplane.fields import check_fields
from meshy.infer.engine import Engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TeacherServiceConfig:
    table: str = "rollout"
    task: str = "teacher"
    top_k: int = 8
    rows_per_lease: int = 8
    lease_s: float = 600.0
    poll_s: float = 0.2

    def __post_init__(self) -> None:
        check_fields(self)
        if self.top_k < 1 or self.rows_per_lease < 1:
            raise SchemaError(f"TeacherServiceConfig: top_k and rows_per_lease must be >= 1: {self}")


class TeacherService:
    def __init__(self, client: DataPlaneClient, engine: Engine, config: TeacherServiceConfig):
        self.client = client
        self.engine = engine
        self.config = config
        self.rows = 0
        self.unscored = 0

    async def run(self, stop: asyncio.Event | None = None, max_rows: int | None = None) -> int:
        cfg = self.config
        stop = stop or asyncio.Event()
        while not stop.is_set() and (max_rows is None or self.rows < max_rows):
            batch = await asyncio.to_thread(
                self.client.lease,
                cfg.table,
                cfg.task,
                [cols.PROMPT_IDS, cols.RESPONSE_IDS],
                count=cfg.rows_per_lease,
                min_count=1,
                lease_s=cfg.lease_s,
                timeout=cfg.poll_s,
            )
            if batch is None:
                continue
            scored = await asyncio.gather(  # in flight together: an engine that batches scores them at once
                *(
                    self._score(prompt, response)
                    for prompt, response in zip(
                        batch.columns[cols.PROMPT_IDS], batch.columns[cols.RESPONSE_IDS], strict=True
                    )
                )
            )
            columns = {
                cols.TEACHER_TOPK_IDS: [s[0] for s in scored],
                cols.TEACHER_TOPK_LOGPROBS: [s[1] for s in scored],
            }
            await asyncio.to_thread(self.client.add_columns, cfg.table, batch.row_ids, columns, ack=batch)
            self.rows += len(batch)
        return self.rows

    async def _score(self, prompt: torch.Tensor, response: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.config.top_k
        if len(response) == 0 or len(prompt) == 0:
            return torch.zeros(0, k, dtype=torch.int64, device=HOST), torch.zeros(0, k, device=HOST)
        try:
            scores = await self.engine.score(torch.cat([prompt, response]).tolist(), top_k=k, start=len(prompt) - 1)
        except SchemaError as e:
            log.warning("teacher cannot score a row (%s); it gets empty columns", e)
            self.unscored += 1
            return torch.zeros(0, k, dtype=torch.int64, device=HOST), torch.zeros(0, k, device=HOST)
        ids = torch.tensor(scores.topk_ids, dtype=torch.int64, device=HOST)
        return ids, torch.tensor(scores.topk_logprobs, dtype=torch.float32, device=HOST)
