"""A role meshy does not know, loaded by import path from a recipe: a stand-in reward model that
writes its own column (response length) for every generated row."""

import torch

from meshy.dataplane import rollout as cols
from meshy.recipes.context import RoleContext


class LengthScorer:
    def __init__(self, ctx: RoleContext, column: str):
        self.ctx = ctx
        self.column = column

    def run(self) -> None:
        self.ctx.watch_for_stop()
        scored = 0
        while not self.ctx.stop.is_set():
            batch = self.ctx.client.lease(
                self.ctx.table, "length_scorer", [cols.RESPONSE_IDS], count=64, min_count=1, timeout=0.5
            )
            if batch is None:
                continue
            lengths = torch.tensor([float(len(r)) for r in batch.columns[cols.RESPONSE_IDS]])
            self.ctx.client.add_columns(self.ctx.table, batch.row_ids, {self.column: lengths}, ack=batch)
            scored += len(batch)
        self.ctx.record("scored", rows=scored)
