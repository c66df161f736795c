"""math-verify in a child process that is killed and restarted when one check runs too long.

math-verify's own timeouts use signal.alarm, which only works on the main thread, and cannot stop a
long computation inside C anyway: `\\boxed{9^{9^{9^{9}}}}` makes sympy start on a number with more digits
than atoms in the universe. Rewards run on a rollout worker thread, so every check goes to a child
(`python -m meshy.recipes.tasks.verify_worker`, timeouts None) over a pipe, one JSON line each way,
and a check past `timeout_s` kills the child and counts as not equivalent. The child imports only
math-verify, never the parent's modules, and may use MEMORY_LIMIT bytes of address space (`2^{2^{40}}`
grows by about 50 MB a second until killed; past the limit it fails with MemoryError, i.e. "not equal").
"""

import atexit
import json
import os
import resource
import select
import subprocess
import sys
import threading
from functools import lru_cache

READY = b"ready\n"
MEMORY_LIMIT = 4 << 30


class VerifyWorker:
    """Thread-safe client of one child process; checks are serialised (rollout scores one at a time)."""

    def __init__(self, timeout_s: float = 5.0, startup_timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        atexit.register(self.close)

    def equivalent(self, gold: str, answer: str) -> bool:
        """Whether math-verify finds `answer` equal to `gold` (both LaTeX or plain text) within the time limit."""
        request = json.dumps({"gold": gold, "answer": answer}).encode() + b"\n"
        with self._lock:
            proc = self._running()
            if proc is None:
                return False
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
            except OSError:
                self._kill()
                return False
            reply = self._read_line(proc, self.timeout_s)
            if reply not in (b"1\n", b"0\n"):  # timed out or died: the next check starts a fresh child
                self._kill()
                return False
            return reply == b"1\n"

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _running(self) -> subprocess.Popen | None:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
        )
        if self._read_line(self._proc, self.startup_timeout_s) != READY:
            self._kill()
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
            self._proc = None

    @staticmethod
    def _read_line(proc: subprocess.Popen, timeout_s: float) -> bytes:
        """One short line from the child, or b"" if none arrives in time (the pipe is unbuffered)."""
        line = b""
        fd = proc.stdout.fileno()
        while not line.endswith(b"\n"):
            if not select.select([fd], [], [], timeout_s)[0]:
                return b""
            chunk = os.read(fd, 64)
            if not chunk:
                return b""
            line += chunk
        return line


def _serve() -> None:
    """Child side: one reply line ("1"/"0") per request line; stdout carries nothing else."""
    replies, sys.stdout = sys.stdout.buffer, sys.stderr
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # the "timeout is disabled" warning, per call

    @lru_cache(maxsize=4096)
    def parse_gold(gold: str) -> list:
        return parse(gold, parsing_timeout=None)

    replies.write(READY)
    replies.flush()
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            answer = parse(request["answer"], parsing_timeout=None)
            ok = bool(answer) and verify(parse_gold(request["gold"]), answer, timeout_seconds=None)
        except Exception:
            ok = False
        replies.write(b"1\n" if ok else b"0\n")
        replies.flush()


if __name__ == "__main__":
    _serve()
