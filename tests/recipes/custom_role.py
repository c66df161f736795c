"""A role meshy does not know, loaded by import path from a recipe: a stand-in reward model that
writes its own column (response length) for every generated row. Its recipe names its task, so no
row is freed before it has scored it; when the run stops it scores what is left, then records."""

import torch

from meshy.dataplane import columns as cols
from meshy.recipes.roles.context import RoleContext


class LengthScorer:
    def __init__(self, ctx: RoleContext, column: str, task: str):
        self.ctx = ctx
        self.column = column
        self.task = task

    def score_ready_rows(self, timeout: float) -> int:
        batch = self.ctx.client.lease(
            self.ctx.table, self.task, [cols.RESPONSE_IDS], count=64, min_count=1, timeout=timeout
        )
        if batch is None:
            return 0
        lengths = torch.tensor([float(len(r)) for r in batch.columns[cols.RESPONSE_IDS]])
        self.ctx.client.add_columns(self.ctx.table, batch.row_ids, {self.column: lengths}, ack=batch)
        return len(batch)

    def run(self) -> None:
        self.ctx.watch_for_stop()
        scored = 0
        while not self.ctx.stop.is_set():
            scored += self.score_ready_rows(timeout=0.5)
        while scored_now := self.score_ready_rows(timeout=0.0):
            scored += scored_now
        self.ctx.record("scored", rows=scored)
