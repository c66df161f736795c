"""A custom role stuck in a loop: it takes rows of another task (with a lease far longer than the test)
and never gives them back, the way a hung scorer or engine would."""

import time

from meshy.dataplane import columns as cols
from meshy.recipes.roles.context import RoleContext


class Hoarder:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx

    def run(self) -> None:
        held = None
        while held is None:  # competes with rollout's scorer for the reward task's rows
            held = self.ctx.client.lease(
                self.ctx.table, cols.REWARD_TASK.name, list(cols.REWARD_TASK.reads), count=4, lease_s=3600, timeout=5
            )
        self.ctx.record("hoarding", rows=len(held.row_ids))
        while True:
            time.sleep(1)
