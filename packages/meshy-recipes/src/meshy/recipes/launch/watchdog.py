"""No run waits silently: rank 0 (the data plane's host) watches the run and stops one that is stuck.

Progress is rows moving on the data plane (written, handed to a task, acked, freed) or a weights
version published. When none happens for `recipe.stall_after_s` seconds, counted from the first
published version (loading or downloading weights before it is not watched), the watchdog writes a
stall report to logs/stall.txt and to stderr: for each task, its rows ready, the leases held on its
rows (by whom, how many, for how long) and the rows that still miss columns, by the columns they miss;
for each GPU token ring, who holds the token, for how long, and who waits for it; and the last record
of every role process. Then it stops the run as a crash would (rank 0 exits with
STALLED), so `meshy run` exits non-zero and prints the resume command.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

from meshy.dataplane import DataPlaneClient, DataPlaneError
from meshy.dataplane.weights import WEIGHTS_STREAM
from meshy.recipes.launch.nodes import STALL_REPORT
from meshy.recipes.roles.context import announce_stop

STALLED = 3  # rank 0's exit code after a stall report
POLL_S = 1.0


class Watchdog:
    def __init__(self, client: DataPlaneClient, tables: list[str], run_dir: Path, stall_after_s: float):
        self.client, self.tables, self.run_dir, self.stall_after_s = client, tables, run_dir, stall_after_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshy-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """The run is ending: stop watching (a run finishing its teardown is not stuck)."""
        self._done.set()

    def _progress(self) -> tuple[str, int]:
        """The tables' counts (rows, leases, each task's ready, leased and done) and the number of
        versions published so far."""
        stats = [self.client.table_stats(table) for table in self.tables]
        return json.dumps(stats, sort_keys=True), self.client.stream_stats(WEIGHTS_STREAM)["next"] - 1

    def _watch(self) -> None:
        try:
            while not self._done.wait(POLL_S):  # the clock starts with the first published version
                if self._progress()[1] > 0:
                    break
            last, since = self._progress(), time.monotonic()
            while not self._done.wait(POLL_S):
                now = self._progress()
                if now != last:
                    last, since = now, time.monotonic()
                elif time.monotonic() - since >= self.stall_after_s:
                    self._stop_stalled()
        except DataPlaneError:
            return  # the data plane itself failed: the roles see it too and the run stops as after a crash

    def report(self) -> str:
        lines = [
            f"meshy: the run made no progress for {self.stall_after_s:.0f} s (no rows moved, no version was published)"
        ]
        waiting = [(t, task, state) for t in self.tables for task, state in self.client.table_waiting(t).items()]
        for table, task, state in sorted(waiting, key=lambda w: w[:2]):
            where = f"{task}" if len(self.tables) == 1 else f"{table}: {task}"
            lines.append(f"  task {where} (needs {', '.join(state['columns'])}): {state['ready']} rows ready")
            for lease in state["leases"]:
                lines.append(f"    {lease['rows']} rows leased by {lease['consumer']} for {lease['held_s']:.0f} s")
            for columns, rows in sorted(state["missing"].items()):
                lines.append(f"    {rows} rows waiting for {columns}")
        for ring, state in sorted(self.client.rings_waiting().items()):
            waiting = ", ".join(state["pending"]) or "nobody"
            lines.append(
                f"  ring {ring}: held by {state['holder']} for {state['held_s']:.0f} s (grant {state['seq']}); "
                f"waiting: {waiting}"
            )
        for path in sorted((self.run_dir / "records").glob("*.jsonl")):
            records = path.read_text().splitlines()
            if records:
                last = json.loads(records[-1])
                age = time.time() - last.pop("time", time.time())
                lines.append(f"  {path.stem}: last record {age:.0f} s ago: {json.dumps(last)[:300]}")
        return "\n".join(lines)

    def _stop_stalled(self) -> None:
        text = self.report()
        (self.run_dir / "logs" / STALL_REPORT).write_text(text + "\n")
        print(text, file=sys.stderr, flush=True)
        announce_stop(self.client, f"stalled for {self.stall_after_s:.0f} s")
        os._exit(STALLED)  # the roles are stuck: stop as a crash does, and torchrun ends the others
