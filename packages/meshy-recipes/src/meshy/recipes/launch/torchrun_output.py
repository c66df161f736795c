"""torchrun's stderr, passed through line by line, and the first failure it reports.

When a worker fails, torchrun ends with a table whose "Root Cause (first observed failure)" entry names
the worker by its torchrun rank and local rank, with its exit code. `meshy run` reads it to say which
of the recipe's processes that was. That report (torchrun's own traceback, then the table: some forty
lines, which meshy run's summary says in a few) goes to a file instead of the terminal, when given one.
"""

import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

_ROOT_CAUSE = "Root Cause (first observed failure)"
_RANK = re.compile(r"^\s*rank\s*:\s*\d+ \(local_rank: (\d+)\)")
_EXIT_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_TRACEBACK = "Traceback (most recent call last):"
_AGENT_FRAME = "torch/distributed/run.py"  # in the first frames of torchrun's own traceback, not of a rank's


@dataclass(frozen=True)
class RootCause:
    local_rank: int
    exit_code: int

    def describe(self) -> str:
        """How the process ended: "exit code 1", "killed by SIGKILL"."""
        return exit_status(self.exit_code)


def exit_status(code: int) -> str:
    """A process's return code in words (negative: the signal that ended it)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class TorchrunOutput:
    """Forwards a torchrun process's stderr to ours and remembers the root cause it reports, if any; its
    failure report goes to `report` instead, if given (the terminal gets a line saying where)."""

    def __init__(self, process: subprocess.Popen, report: Path | None = None):
        self.root_cause: RootCause | None = None
        self.report = report
        self._thread = threading.Thread(target=self._forward, args=(process.stderr,), daemon=True)
        self._thread.start()

    def _forward(self, stream) -> None:
        held: list[str] = []  # the start of a traceback, until it is known whose it is
        agent = False  # held is torchrun's own failure report
        in_root_cause, local_rank = False, None
        for line in stream:
            if self.report is not None and not agent and line.startswith(_TRACEBACK):
                self._show(held)
                held = [line]
            elif agent:
                held.append(line)
                if in_root_cause and line.startswith("====="):  # the end of the report
                    self._set_aside(held)
                    held, agent = [], False
            elif held:
                held.append(line)
                agent = _AGENT_FRAME in line
                if not agent and not line.startswith((" ", "\t")):  # its last line: a rank's traceback
                    self._show(held)
                    held = []
            else:
                self._show([line])
            if _ROOT_CAUSE in line:
                in_root_cause = True
            elif in_root_cause and self.root_cause is None:
                if (rank := _RANK.match(line)) is not None:
                    local_rank = int(rank.group(1))
                elif (code := _EXIT_CODE.match(line)) is not None and local_rank is not None:
                    self.root_cause = RootCause(local_rank, int(code.group(1)))
        if agent:
            self._set_aside(held)
        else:
            self._show(held)

    def _show(self, lines: list[str]) -> None:
        sys.stderr.writelines(lines)
        sys.stderr.flush()

    def _set_aside(self, lines: list[str]) -> None:
        with open(self.report, "a") as f:
            f.writelines(lines)
        self._show([f"meshy: torchrun's own report of the failure: {self.report}\n"])

    def finish(self, timeout_s: float = 10.0) -> RootCause | None:
        """Once torchrun has exited: the rest of its output forwarded, the root cause it named."""
        self._thread.join(timeout_s)
        return self.root_cause
