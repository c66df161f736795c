"""The sandbox for tools that run code, tried with real hostile code in real processes: every call ends
within its limits, reports why, and leaves no process behind."""

import asyncio
import dataclasses
import os
import resource
import socket
import time
from pathlib import Path

import pytest

from meshy.dataplane import SchemaError
from meshy.dataplane.security import SECRET_ENV
from meshy.recipes.agents.python_tool import python_tool
from meshy.recipes.agents.sandbox import (
    BOOTSTRAP,
    CPU_TIME,
    OUTPUT,
    STOP_GRACE_S,
    WALL_CLOCK,
    SandboxLimits,
    check_sandbox,
    run_python,
)
from meshy.recipes.agents.sandbox_bootstrap import SANDBOX_UID
from meshy.recipes.agents.tool_calls import ToolCall
from meshy.recipes.agents.tools import BAD_ARGUMENTS, KILLED, RAISED, TIMEOUT, ToolBox

LIMITS = SandboxLimits(cpu_s=1, memory_bytes=256 << 20, wall_s=3.0, max_output_bytes=4096, max_processes=8)
WHY_NOT = check_sandbox()
needs_sandbox = pytest.mark.skipif(WHY_NOT is not None, reason=f"no sandbox on this machine: {WHY_NOT}")


def run(code: str, limits: SandboxLimits = LIMITS):
    return asyncio.run(run_python(code, limits))


def sandbox_processes() -> set[tuple[str, str]]:
    """(pid, start time) of every process that may be a sandbox's: the bootstrap's, uid 65534's, or one in a
    pid namespace other than ours (what the code exec'd)."""
    ours, found = os.readlink("/proc/self/ns/pid"), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            namespace = os.readlink(f"/proc/{pid}/ns/pid") if "\nState:\tZ" not in status else ours
        except OSError:  # gone, or not ours to look at
            continue
        uid = status.split("\nUid:")[1].split()[0]
        if BOOTSTRAP.encode() in cmdline or uid == str(SANDBOX_UID) or namespace != ours:
            found.add((pid, stat.rsplit(")", 1)[1].split()[19]))
    return found


@pytest.fixture
def nothing_left(sandboxes_alone):
    """Fails the test if a sandbox process outlives it; yields the processes there were before."""
    before = sandbox_processes()
    yield before
    assert sandbox_processes() - before == set()


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("cpu_s", 0, "cpu_s: expected an integer in 1..2**62, got 0"),
        ("cpu_s", 1.5, "cpu_s: expected an integer in 1..2**62, got 1.5"),
        ("cpu_s", True, "cpu_s: expected an integer in 1..2**62, got True"),
        ("memory_bytes", 1 << 20, "memory_bytes: expected an integer in 67108864..2**62, got 1048576"),
        ("memory_bytes", 2**63, "memory_bytes: expected an integer in 67108864..2**62, got 9223372036854775808"),
        ("max_output_bytes", "4096", "max_output_bytes: expected an integer in 1..2**62, got '4096'"),
        ("max_processes", -1, "max_processes: expected an integer in 1..2**62, got -1"),
        ("scratch_bytes", None, "scratch_bytes: expected an integer in 1..2**62, got None"),
        ("wall_s", 0, "wall_s: expected a number of seconds > 0, got 0"),
        ("wall_s", float("inf"), "wall_s: expected a number of seconds > 0, got inf"),
        ("wall_s", float("nan"), "wall_s: expected a number of seconds > 0, got nan"),
        ("wall_s", "3", "wall_s: expected a number of seconds > 0, got '3'"),
    ],
)
def test_a_bad_limit_is_refused_naming_the_field(field, value, expected):
    with pytest.raises(SchemaError) as refused:
        SandboxLimits(**{field: value})
    assert str(refused.value) == f"SandboxLimits.{expected}"


@needs_sandbox
def test_what_the_code_prints_comes_back_with_its_exit_status(nothing_left):
    result = run("import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\nprint(2**100)")
    assert (result.stdout, result.stderr, result.exit_status, result.killed) == (
        "to stdout\n1267650600228229401496703205376\n",
        "to stderr\n",
        0,
        None,
    )
    assert run("import sys\nsys.exit(3)").exit_status == 3
    raised = run("x = 1\nraise ValueError('bad value')")
    assert raised.exit_status == 1 and raised.killed is None
    assert raised.stderr.endswith("line 2, in <module>\n    raise ValueError('bad value')\nValueError: bad value\n")


@needs_sandbox
def test_an_endless_loop_is_stopped_at_its_cpu_time_or_wall_clock_limit(nothing_left):
    patient = dataclasses.replace(LIMITS, wall_s=10.0)  # time for a CPU second or two on a busy machine
    spin = run("while True:\n    pass", patient)
    assert (spin.killed, spin.exit_status) == (CPU_TIME, None)
    # SIGXCPU ignored: the kernel's SIGKILL a CPU second later
    ignore = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    assert run(ignore, patient).killed == CPU_TIME
    start, short = time.monotonic(), dataclasses.replace(LIMITS, wall_s=1.0)
    sleeper = run("import time\nprint('going to sleep', flush=True)\ntime.sleep(60)", short)
    assert (sleeper.killed, sleeper.exit_status, sleeper.stdout) == (WALL_CLOCK, None, "going to sleep\n")
    assert short.wall_s <= time.monotonic() - start < short.wall_s + STOP_GRACE_S
    killed = run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")  # no CPU used: not a CPU kill
    assert (killed.killed, killed.exit_status) == (None, -9)


FORK_BOMBS = {
    "fork": "import os\nwhile True:\n    os.fork()",
    "fork, errors ignored": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "threads": "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()",
    "subprocess": "import subprocess\nwhile True:\n    subprocess.Popen(['sleep', '60'])",
    "detached": "import os, time\n"
    "for _ in range(4):\n    if not os.fork():\n        os.setsid()\n        time.sleep(60)",
}


@needs_sandbox
@pytest.mark.parametrize("bomb", list(FORK_BOMBS))
def test_a_fork_bomb_is_contained_and_nothing_of_it_is_left(bomb, nothing_left):
    async def bombed_while_counting():
        peak, sandbox = 0, asyncio.create_task(run_python(FORK_BOMBS[bomb], LIMITS))
        while not sandbox.done():
            peak = max(peak, len(sandbox_processes() - nothing_left))
            await asyncio.sleep(0.02)
        return sandbox.result(), peak

    start = time.monotonic()
    result, peak = asyncio.run(bombed_while_counting())
    assert time.monotonic() - start < LIMITS.wall_s + STOP_GRACE_S
    assert peak <= LIMITS.max_processes + 2  # the code's processes, the init and the supervisor
    assert result.killed in (None, CPU_TIME, WALL_CLOCK), result
    # the code's own process ended at once (detached: by design; the others: out of processes), and its
    # children went with the sandbox
    if bomb != "fork, errors ignored":
        assert result.killed is None and result.seconds < LIMITS.wall_s / 2, result


@needs_sandbox
def test_a_10_gb_allocation_fails_inside_and_the_caller_is_unharmed(nothing_left):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    huge = run("x = bytearray(10 * 2**30)")
    assert huge.exit_status == 1 and huge.stderr.endswith("MemoryError\n"), huge
    caught = run("try:\n    x = bytearray(10 * 2**30)\nexcept MemoryError:\n    print('refused')\nprint('going on')")
    assert (caught.stdout, caught.exit_status) == ("refused\ngoing on\n", 0)
    grown = run("chunks = []\nwhile True:\n    chunks.append(bytearray(2**20))")
    assert grown.exit_status == 1 and grown.stderr.endswith("MemoryError\n"), grown
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 100_000  # KiB
    assert run("print('still here')").stdout == "still here\n"


LOOK_FOR_THE_SECRET = """
import os
print(sorted(os.environ))
open_descriptors = []
for fd in range(1024):
    try:
        os.fstat(fd)
        open_descriptors.append(fd)
    except OSError:
        pass
print(open_descriptors)
seen = repr(dict(os.environ))
for pid in ["self", "1", PARENT] + [p for p in os.listdir("/proc") if p.isdigit()]:
    for name in ("environ", "cmdline"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                seen += repr(f.read())
        except OSError as e:
            print(pid, name, type(e).__name__)
print(SECRET in seen, "searched", len(seen))
"""


@needs_sandbox
def test_the_code_starts_clean_and_the_runs_secret_is_nowhere_to_be_read(monkeypatch, nothing_left):
    secret = "meshy-test-secret-0123456789abcdef"
    monkeypatch.setenv(SECRET_ENV, secret)
    code = f"PARENT = {str(os.getpid())!r}\nSECRET = {secret[::-1]!r}[::-1]\n{LOOK_FOR_THE_SECRET}"
    result = run(code)
    assert result.exit_status == 0, result
    assert secret not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "['LC_CTYPE']"  # the interpreter's own locale coercion, nothing inherited
    assert lines[1] == "[0, 1, 2]"  # nor any descriptor: not the bootstrap's status pipe
    assert f"{os.getpid()} environ FileNotFoundError" in lines  # the caller is not in the sandbox's /proc
    assert "1 environ PermissionError" in lines  # nor may the code read its init's
    assert lines[-1].startswith("False searched")


@needs_sandbox
def test_no_connection_leaves_the_sandbox(nothing_left):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = f"""
import socket
for address in [("127.0.0.1", {port}), ("localhost", {port}), ("8.8.8.8", 53), ("1.1.1.1", 443)]:
    try:
        socket.create_connection(address, timeout=1).close()
        print(address, "connected")
    except OSError as e:
        print(address, type(e).__name__, e.errno)
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("8.8.8.8", 53))
    print("udp sent")
except OSError as e:
    print("udp", type(e).__name__, e.errno)
"""
        result = run(code)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody came
    lines = result.stdout.splitlines()
    assert result.exit_status == 0 and len(lines) == 5, result
    # ENETUNREACH: no route at all, not even a loopback ("localhost" may also fail to resolve)
    for line in (lines[0], *lines[2:4]):
        assert line.endswith("OSError 101"), line
    assert "connected" not in lines[1]
    assert lines[4] == "udp OSError 101"


@needs_sandbox
def test_the_host_is_read_only_and_scratch_space_is_private(tmp_path, nothing_left):
    scratch = f"/tmp/meshy-sandbox-test-{os.getpid()}"
    code = f"""
for path in ({str(tmp_path / "x")!r}, {str(Path(BOOTSTRAP).with_name("x"))!r}, "/etc/x", {scratch!r}, "/dev/shm/x"):
    try:
        with open(path, "w") as f:
            f.write("written")
        print(path, "written")
    except OSError as e:
        print(path, type(e).__name__)
"""
    result = run(code)
    # A checkout under /tmp (a clone made there) is hidden with the host's /tmp; anywhere else it is read-only.
    hidden = Path(BOOTSTRAP).is_relative_to("/tmp")
    assert result.stdout.splitlines() == [
        f"{tmp_path / 'x'} FileNotFoundError",  # the host's /tmp is not there
        f"{Path(BOOTSTRAP).with_name('x')} {'FileNotFoundError' if hidden else 'OSError'}",  # EROFS when visible
        "/etc/x OSError",
        f"{scratch} written",
        "/dev/shm/x written",
    ]
    assert not Path(scratch).exists()  # written to the sandbox's own /tmp, gone with it


@needs_sandbox
def test_an_output_flood_is_cut_and_stopped(nothing_left):
    for stream in ("", ", file=__import__('sys').stderr"):
        result = run(f"while True:\n    print('x' * 1000{stream})")
        flooded = result.stderr if stream else result.stdout
        assert result.killed == OUTPUT and result.seconds < LIMITS.wall_s, result
        assert flooded.endswith(f"\n[output cut at {LIMITS.max_output_bytes} bytes]")
        assert len(flooded) == LIMITS.max_output_bytes + len(f"\n[output cut at {LIMITS.max_output_bytes} bytes]")


@needs_sandbox
def test_many_concurrent_calls_all_finish_and_a_cancelled_one_is_stopped(nothing_left):
    async def sixteen():
        return await asyncio.gather(*(run_python(f"print({i} ** 2)", LIMITS) for i in range(16)))

    results = asyncio.run(sixteen())
    assert [(r.stdout, r.exit_status, r.killed) for r in results] == [(f"{i**2}\n", 0, None) for i in range(16)]

    async def cancelled():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(run_python("import time\ntime.sleep(60)", LIMITS), 0.5)

    asyncio.run(cancelled())  # nothing_left: the sandbox was stopped and reaped before wait_for returned


@needs_sandbox
def test_the_python_tool_answers_every_outcome_with_an_observation(nothing_left):
    limits = dataclasses.replace(LIMITS, wall_s=6.0)  # the CPU-bound call's second, on a busy machine
    box = ToolBox([python_tool(limits)], timeout_s=limits.wall_s + 5)
    calls = {
        "print(6 * 7)": (None, "42\n"),
        "import sys\nprint('warned', file=sys.stderr)\nprint(1)": (None, "1\n\n[stderr]\nwarned\n"),
        "1 / 0": (RAISED, "error: python: the code exited with status 1; output:\n\n[stderr]\nTraceback"),
        "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)": (RAISED, "error: python: the code was ended by"),
        "import time\ntime.sleep(60)": (TIMEOUT, "error: python: the code ran past its 6 s and was stopped"),
        "while True:\n    pass": (KILLED, "error: python: the code used its 1 s of CPU time and was stopped"),
        "while True:\n    print('x')": (KILLED, "error: python: the code printed more than 4096 bytes"),
    }

    async def all_calls():
        tried = [box.call(ToolCall("python", {"code": code})) for code in calls]
        return await asyncio.gather(*tried, box.call(ToolCall("python", {"code": 7})))

    *results, mistyped = asyncio.run(all_calls())
    for result, (error, content) in zip(results, calls.values(), strict=True):
        assert (result.error, result.content[: len(content)]) == (error, content), result
    assert mistyped.error == BAD_ARGUMENTS
    assert "signal 11 (Segmentation fault)" in results[3].content
