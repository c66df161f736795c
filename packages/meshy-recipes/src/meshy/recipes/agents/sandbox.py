"""Untrusted Python source run in a fresh, killable sandbox: `await run_python(code, limits)`.

What the sandbox promises (Linux; where the kernel refuses the namespaces it needs, nothing runs:
`check_sandbox()` says why, and code tools refuse to start):
- No network: the code runs in a network namespace of its own with only a loopback that is down, so it
  reaches no address at all, the host's loopback (the data plane) included, nor the host's abstract Unix
  sockets.
- No view of other processes: in a pid namespace of its own with its own /proc, it sees only the processes
  it started and the sandbox's init (which it may not ptrace), and signals or ptraces only its own; not
  the caller, nor its environment or memory.
- A clean start: no environment variable is inherited (the run's secret, MESHY_DATAPLANE_SECRET, is never
  there), no file descriptor beyond stdin (empty), stdout and stderr, no capability (no_new_privs, so no
  setuid program gives it any); when the caller is root, the code runs as uid/gid 65534 with no
  supplementary groups.
- A read-only host: every host mount is read-only inside; /tmp, /dev/shm and /run are private tmpfs of
  `scratch_bytes` each, gone after the call (which also hides the host's sockets under them).
- Limits: CPU time of each process (`cpu_s`: SIGXCPU, then SIGKILL), address space of each process
  (`memory_bytes`: an allocation beyond it fails, in Python with MemoryError), processes and threads at
  once (`max_processes`, the code's own included), the size of any file it writes, 64 open files, no core
  dumps, wall-clock time of the whole call (`wall_s`, start-up included), and `max_output_bytes` of stdout
  and of stderr each (more kills the code).
- Killed and reaped as a whole: when the code's process ends, when a limit is hit, or when the call is
  cancelled, every process of the sandbox is killed and reaped before the call returns; if the caller
  dies, the kernel kills the sandbox after it (and the host's init reaps it).

What it does NOT promise:
- Secrecy of files: the code reads every host file its uid may read: world-readable files when the caller
  is root (the project's source, /etc, /sys), and everything the caller can read when the caller is not
  root (then the code runs as the caller's own uid and keeps the caller's supplementary groups). Keep
  secrets out of such files; the run's secret lives only in environments.
- Isolation from the kernel: it shares the host's kernel, with no seccomp filter; it is no defence against
  a kernel exploit, and the code may create namespaces of its own (which give it nothing over these).
- Unix sockets on the filesystem outside /tmp, /dev/shm and /run: one its uid may write to it can connect to.
- A bound on the whole sandbox's memory or CPU share: the limits are per process (no cgroup), so a sandbox
  may hold up to `max_processes` times `memory_bytes` of address space plus its tmpfs, and compete for CPU
  with the run until `wall_s`.
- Hiding the machine: the kernel version, CPU, memory size, hostname and the host's mount table are visible.
- Modules: when the caller is root, only the standard-library modules the bootstrap imports beforehand
  (sandbox_bootstrap.PRELOAD) can be imported if the interpreter's files are not world-readable; never
  site-packages.
"""

import asyncio
import functools
import json
import math
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from meshy.dataplane import SchemaError

BOOTSTRAP = str(Path(__file__).with_name("sandbox_bootstrap.py"))
MIN_MEMORY_BYTES = 64 << 20  # the interpreter itself needs about 30 MiB of address space
STOP_GRACE_S = 2.0  # how long a SIGTERMed supervisor has to kill and reap the sandbox before SIGKILL

# SandboxResult.killed: why the sandbox stopped the code (None: it ended on its own)
WALL_CLOCK = "wall-clock"
CPU_TIME = "cpu-time"
OUTPUT = "output"


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be built (or did not report), so the code was not run, or not to the end."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5  # CPU seconds of each process (RLIMIT_CPU counts whole seconds)
    memory_bytes: int = 512 << 20  # address space of each process (RLIMIT_AS)
    wall_s: float = 10.0  # of the whole call, start-up (about 0.1-0.3 s) included
    max_output_bytes: int = 16 << 10  # of stdout and of stderr each
    max_processes: int = 16  # processes and threads at once, the code's own process included
    scratch_bytes: int = 16 << 20  # of each private tmpfs, and of any file written (RLIMIT_FSIZE)

    def __post_init__(self) -> None:
        for name, low in _INTEGER_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= _MAX_LIMIT:
                raise SchemaError(f"SandboxLimits.{name}: expected an integer in {low}..2**62, got {value!r}")
        wall_s = self.wall_s
        if not isinstance(wall_s, int | float) or isinstance(wall_s, bool) or not 0 < wall_s < math.inf:
            raise SchemaError(f"SandboxLimits.wall_s: expected a number of seconds > 0, got {wall_s!r}")


_INTEGER_FIELDS = (
    ("cpu_s", 1),
    ("memory_bytes", MIN_MEMORY_BYTES),
    ("max_output_bytes", 1),
    ("max_processes", 1),
    ("scratch_bytes", 1),
)
_MAX_LIMIT = 2**62  # what every rlimit (and cpu_s + 1) holds


@dataclass(frozen=True)
class SandboxResult:
    stdout: str  # decoded as UTF-8 (bad bytes replaced), ending "[output cut at N bytes]" when cut
    stderr: str
    exit_status: int | None  # the exit code, -N when signal N ended it; None when killed is set
    killed: str | None  # None, or one of WALL_CLOCK, CPU_TIME, OUTPUT
    seconds: float


class _Capture:
    """One output stream, kept up to `limit` bytes; past it, the sandbox is stopped."""

    def __init__(self, limit: int) -> None:
        self.limit, self.data, self.cut = limit, bytearray(), False

    async def drain(self, stream: asyncio.StreamReader, process: asyncio.subprocess.Process) -> None:
        """Read to the end: past the limit, stop the sandbox and throw the rest away."""
        while chunk := await stream.read(1 << 16):
            room = self.limit - len(self.data)
            self.data += chunk[: max(room, 0)]
            if len(chunk) > room and not self.cut:
                self.cut = True
                _terminate(process)

    def text(self) -> str:
        text = self.data.decode("utf-8", "replace")
        return f"{text}\n[output cut at {self.limit} bytes]" if self.cut else text


async def run_python(code: str, limits: SandboxLimits) -> SandboxResult:
    """Run `code` as __main__ in a fresh sandbox; raises SandboxUnavailable if the boundary could not be
    built (the code was not run)."""
    start = time.monotonic()
    status_read, status_write = os.pipe()
    try:
        config = {
            "cpu_s": limits.cpu_s,
            "memory_bytes": limits.memory_bytes,
            "max_processes": limits.max_processes,
            "scratch_bytes": limits.scratch_bytes,
            "status_fd": status_write,
        }
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", BOOTSTRAP, json.dumps(config),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={},
                cwd="/",
                start_new_session=True,
                pass_fds=(status_write,),
            )  # fmt: skip
        finally:
            os.close(status_write)
        stdout, stderr = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
        timed_out = await _supervise(process, code, stdout, stderr, limits.wall_s)
        reports = _read_reports(status_read)
    finally:
        os.close(status_read)
    seconds = time.monotonic() - start
    if errors := [report["error"] for report in reports if "error" in report]:
        raise SandboxUnavailable(f"the sandbox could not be built: {errors[0]}")
    if stdout.cut or stderr.cut or timed_out:
        return SandboxResult(stdout.text(), stderr.text(), None, OUTPUT if not timed_out else WALL_CLOCK, seconds)
    ended = next((report for report in reports if "wait_status" in report), None)
    if ended is None:
        raise SandboxUnavailable(
            f"the sandbox ended without reporting how the code ended (supervisor exit status "
            f"{process.returncode}): {stderr.text()[-2000:]}"
        )
    exit_status = os.waitstatus_to_exitcode(ended["wait_status"])
    # SIGXCPU comes from the kernel at the soft limit (or from the code itself, which then misreports only
    # itself), SIGKILL at the hard limit a CPU second later: there the CPU time used tells it from another
    # SIGKILL (the kernel's count of it may show up to ~15% less on a busy machine, well under that second)
    if exit_status == -signal.SIGXCPU or (exit_status == -signal.SIGKILL and ended["cpu_s"] >= limits.cpu_s):
        return SandboxResult(stdout.text(), stderr.text(), None, CPU_TIME, seconds)
    return SandboxResult(stdout.text(), stderr.text(), exit_status, None, seconds)


async def _supervise(
    process: asyncio.subprocess.Process, code: str, stdout: _Capture, stderr: _Capture, wall_s: float
) -> bool:
    """Feed the code, capture the output and wait, for at most `wall_s`; whatever happens (the caller's
    cancellation included) the sandbox is stopped and reaped before this returns. True: it ran out of time."""
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    tasks = [
        asyncio.create_task(_feed(process.stdin, code.encode("utf-8", "surrogatepass"))),
        asyncio.create_task(stdout.drain(process.stdout, process)),
        asyncio.create_task(stderr.drain(process.stderr, process)),
        asyncio.create_task(process.wait()),
    ]
    try:
        _, running = await asyncio.wait(tasks, timeout=wall_s)
        return bool(running) and not (stdout.cut or stderr.cut)
    finally:
        await _stop(process)
        await asyncio.wait(tasks, timeout=STOP_GRACE_S)  # the pipes close with the sandbox's last process
        for task in tasks:
            task.cancel()


async def _feed(stdin: asyncio.StreamWriter, code: bytes) -> None:
    try:
        stdin.write(code)
        await stdin.drain()
    except (BrokenPipeError, ConnectionResetError):  # the sandbox ended before reading it all
        pass
    finally:
        stdin.close()


def _terminate(process: asyncio.subprocess.Process) -> None:
    """Ask the supervisor to kill the sandbox's pid namespace (it then reaps the namespace's init)."""
    if process.returncode is None:
        with suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is not None:
        return
    _terminate(process)
    try:
        await asyncio.wait_for(process.wait(), STOP_GRACE_S)
    except TimeoutError:  # the supervisor did not act on SIGTERM: kill its process group (the init with it)
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


def _read_reports(status_read: int) -> list[dict]:
    """The bootstrap's JSON lines; once the supervisor has exited, none is still to come."""
    os.set_blocking(status_read, False)
    data = b""
    with suppress(BlockingIOError):
        while chunk := os.read(status_read, 1 << 16):
            data += chunk
    return [json.loads(line) for line in data.splitlines()]


_PROBE_LOCK = threading.Lock()


def check_sandbox() -> str | None:
    """Why this machine cannot build the sandbox, or None when it can; probed once per process (by running
    a sandbox, about 0.2 s)."""
    with _PROBE_LOCK:
        return _probe()


@functools.cache
def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux namespaces; this is {sys.platform}"
    limits = SandboxLimits(cpu_s=2, wall_s=20.0, max_processes=4)
    with ThreadPoolExecutor(1) as thread:  # an event loop of its own, whether or not the caller runs one
        try:
            result = thread.submit(lambda: asyncio.run(run_python("print('ok')", limits))).result()
        except SandboxUnavailable as e:
            return f"{e} (code tools refuse to run without the boundary rather than run with part of it)"
    if (result.stdout, result.exit_status) != ("ok\n", 0):
        return f"the sandbox's probe printed {result.stdout!r}, {result.stderr!r} (exit status {result.exit_status})"
    return None
