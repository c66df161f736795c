"""torchrun's stderr, passed through line by line, and the first failure it reports.

When a worker fails, torchrun ends with a table whose "Root Cause (first observed failure)" entry names
the worker by its torchrun rank and local rank, with its exit code. `meshy run` reads it to say which
of the recipe's processes that was.
"""

import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

_ROOT_CAUSE = "Root Cause (first observed failure)"
_RANK = re.compile(r"^\s*rank\s*:\s*\d+ \(local_rank: (\d+)\)")
_EXIT_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


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
    """Forwards a torchrun process's stderr to ours and remembers the root cause it reports, if any."""

    def __init__(self, process: subprocess.Popen):
        self.root_cause: RootCause | None = None
        self._thread = threading.Thread(target=self._forward, args=(process.stderr,), daemon=True)
        self._thread.start()

    def _forward(self, stream) -> None:
        in_root_cause, local_rank = False, None
        for line in stream:
            sys.stderr.write(line)
            sys.stderr.flush()
            if _ROOT_CAUSE in line:
                in_root_cause = True
            elif in_root_cause and self.root_cause is None:
                if (rank := _RANK.match(line)) is not None:
                    local_rank = int(rank.group(1))
                elif (code := _EXIT_CODE.match(line)) is not None and local_rank is not None:
                    self.root_cause = RootCause(local_rank, int(code.group(1)))

    def finish(self, timeout_s: float = 10.0) -> RootCause | None:
        """Once torchrun has exited: the rest of its output forwarded, the root cause it named."""
        self._thread.join(timeout_s)
        return self.root_cause
