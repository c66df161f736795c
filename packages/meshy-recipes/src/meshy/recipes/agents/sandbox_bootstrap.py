"""The program a sandbox runs (`python -I -S sandbox_bootstrap.py CONFIG`, the code on stdin): it builds the
boundary (meshy.recipes.agents.sandbox says which), then runs the code; standard library only, since it
runs without site-packages.

Three processes. The supervisor (this interpreter as started) imports everything the code may import
(once the uid is dropped the interpreter's own files may be unreadable), drops to uid/gid 65534 when it
runs as root, enters new user, network, pid, mount and IPC namespaces and forks the init. The init (pid 1
of the new pid namespace) mounts a private /proc and scratch tmpfs on /tmp, /dev/shm and /run, makes the
rest of the filesystem read-only, drops every capability and forks the code's process, then reaps until that
process ends; when the init exits, the kernel kills whatever else is left in the namespace. The code's
process sets the rlimits and runs the code. The supervisor stays in the caller's pid namespace so the
caller can stop everything: on SIGTERM it SIGKILLs the init and reaps it.

Reports go to the status pipe (the fd in CONFIG), which the code's process closes before the code runs, so
the code cannot forge them: JSON lines, {"error": why the boundary could not be built} from whichever step
failed, and from the init {"wait_status": the code's process's wait status, "cpu_s": the CPU time it used}.
"""

import contextlib
import ctypes
import json
import linecache
import os
import resource
import signal
import sys
import traceback

# Imported here, before the uid drop, so the code may import them (sys.modules); the rest of the standard
# library may be unreadable to it.
PRELOAD = (
    "array",
    "base64",
    "bisect",
    "cmath",
    "collections",
    "collections.abc",
    "contextlib",
    "copy",
    "datetime",
    "decimal",
    "encodings.ascii",
    "encodings.idna",
    "encodings.latin_1",
    "enum",
    "fractions",
    "functools",
    "hashlib",
    "heapq",
    "io",
    "itertools",
    "json",
    "math",
    "numbers",
    "operator",
    "random",
    "re",
    "socket",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "textwrap",
    "threading",
    "time",
    "typing",
    "unicodedata",
)

SANDBOX_UID = 65534  # the host uid the code runs as when the caller is root ("nobody")
INSIDE_ID = 1000  # the uid and gid the code sees: not 0, so exec never hands it root's capabilities
SETUP_FAILED = 70
MAX_OPEN_FILES = 64

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_PRIVATE = 0x2, 0x4, 0x8, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, AT_FDCWD, AT_RECURSIVE = 0x1, 0x2, -100, 0x8000
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (Linux >= 5.12)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of building the boundary failed: the code is not run."""


class _MountAttr(ctypes.Structure):
    _fields_ = tuple((name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd"))


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32))


def _checked(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: [Errno {errno}] {os.strerror(errno)}")


def _prctl(option: int, value: int, what: str) -> None:
    arguments = (ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    _checked(_libc.prctl(ctypes.c_int(option), *arguments), what)


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise SetupError(f"writing {text!r} to {path}: {e}") from None


def _mount(source: str, target: str, fstype: str, flags: int, data: str | None = None) -> None:
    options = data.encode() if data is not None else None
    result = _libc.mount(source.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags), options)
    _checked(result, f"mount {fstype} on {target}")


def _set_parent_death_signal() -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")


def _enter_namespaces() -> None:
    """Drop root (the kernel does not count root's processes against RLIMIT_NPROC), then new namespaces in
    which the code sees one uid and gid of its own."""
    if os.geteuid() == 0:
        try:
            os.setgroups([])
            os.setresgid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
            os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
        except OSError as e:
            raise SetupError(f"dropping to uid {SANDBOX_UID}: {e}") from None
        # the uid change made this process non-dumpable, and so its /proc/self root's: uid_map unwritable
        _prctl(PR_SET_DUMPABLE, 1, "prctl(PR_SET_DUMPABLE)")
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC
    _checked(_libc.unshare(flags), "unshare(user, network, pid, mount and IPC namespaces)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{INSIDE_ID} {uid} 1")
    _write("/proc/self/gid_map", f"{INSIDE_ID} {gid} 1")


def _build_filesystem(scratch_bytes: int) -> None:
    """Nothing shared with the host's mounts, a /proc of this pid namespace, every host file read-only, and
    scratch space of our own."""
    attr = _MountAttr(attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, propagation=MS_PRIVATE)
    arguments = (ctypes.c_long(AT_FDCWD), ctypes.c_char_p(b"/"), ctypes.c_long(AT_RECURSIVE))
    result = _libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), *arguments, ctypes.byref(attr), ctypes.c_size_t(32))
    _checked(result, "mount_setattr(/, recursive, read-only, private)")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for scratch in ("/tmp", "/dev/shm", "/run"):  # /run also hides the host's Unix sockets (D-Bus, Docker)
        if os.path.isdir(scratch):
            _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch_bytes},mode=1777")
    os.chdir("/tmp")


def _drop_capabilities() -> None:
    """No capability in the namespace (no remounting, no network configuration), none to gain by exec."""
    _checked(_libc.capset(ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), (_CapData * 2)()), "capset(none)")
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")


def _report(status_fd: int, message: dict) -> None:
    os.write(status_fd, json.dumps(message).encode() + b"\n")  # one line, well under PIPE_BUF: never blocks


def _limit_code_process(config: dict) -> None:
    _prctl(PR_SET_DUMPABLE, 1, "prctl(PR_SET_DUMPABLE)")  # the init is not
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for limit, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, MAX_OPEN_FILES),
        (resource.RLIMIT_FSIZE, config["scratch_bytes"]),
        (resource.RLIMIT_AS, config["memory_bytes"]),
        (resource.RLIMIT_NPROC, config["max_processes"] + 2),  # the supervisor and the init count too
    ):
        resource.setrlimit(limit, (value, value))
    # SIGXCPU at the soft limit, SIGKILL a second later for code that ignores it
    resource.setrlimit(resource.RLIMIT_CPU, (config["cpu_s"], config["cpu_s"] + 1))


def _run_code(source: bytes, config: dict, status_fd: int) -> None:
    """In the code's process: limits, then the code as __main__; never returns."""
    try:
        _limit_code_process(config)
    except (SetupError, OSError, ValueError) as e:
        _report(status_fd, {"error": f"limiting the code's process: {e}"})
        os._exit(SETUP_FAILED)
    os.close(status_fd)  # the only descriptor inherited beyond 0-2 (the caller passes no other)
    lines = source.decode("utf-8", "replace").splitlines(keepends=True)
    linecache.cache["<code>"] = (len(source), None, lines, "<code>")  # tracebacks show the code's lines
    status = 0
    try:
        exec(compile(source, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this runner's frame
        status = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status & 0xFF)


def _init(source: bytes, config: dict, status_fd: int) -> None:
    """Pid 1 of the sandbox's pid namespace: its exit ends every process left in it. Never returns."""
    try:
        _set_parent_death_signal()  # the supervisor dies only by a SIGKILL from outside, which this follows
        _build_filesystem(config["scratch_bytes"])
        _drop_capabilities()
        _prctl(PR_SET_DUMPABLE, 0, "prctl(PR_SET_DUMPABLE)")  # so the code cannot ptrace the init
        code_process = os.fork()
    except (SetupError, OSError) as e:
        _report(status_fd, {"error": str(e)})
        os._exit(SETUP_FAILED)
    if code_process == 0:
        _run_code(source, config, status_fd)
    while True:  # reap orphans until the code's process ends
        pid, wait_status, usage = os.wait4(-1, 0)
        if pid == code_process:
            _report(status_fd, {"wait_status": wait_status, "cpu_s": usage.ru_utime + usage.ru_stime})
            os._exit(0)


def main() -> None:
    init_pid = 0

    def stop(signum: int, frame: object) -> None:
        if init_pid:
            os.kill(init_pid, signal.SIGKILL)  # the init's wait below then returns
        else:
            os._exit(SETUP_FAILED)

    signal.signal(signal.SIGTERM, stop)
    config = json.loads(sys.argv[1])
    status_fd, parent = config["status_fd"], os.getppid()
    source = sys.stdin.buffer.read()
    try:
        for module in PRELOAD:
            __import__(module)
        _enter_namespaces()
        _set_parent_death_signal()  # after the uid change, which clears it
        if os.getppid() != parent:
            os._exit(SETUP_FAILED)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # until init_pid is known
        child = os.fork()
    except (SetupError, OSError, ImportError) as e:
        _report(status_fd, {"error": str(e)})
        os._exit(SETUP_FAILED)
    if child == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _init(source, config, status_fd)
    init_pid = child
    os.close(status_fd)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.waitpid(child, 0)


if __name__ == "__main__":
    main()
