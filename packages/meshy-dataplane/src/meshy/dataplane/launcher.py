"""The data-plane server processes: `python -m meshy.dataplane.launcher CONFIG_JSON` (secret in the env).

Importing TransferQueue costs seconds (torch, tensordict), so this process imports it once and forks
the storage units, and later the controller, from that state. It starts this host's storage units and
prints one JSON line (their endpoints and pids); a host that also runs the controller then writes one
JSON line to its stdin with the storage units of the whole run (every node's), and the launcher forks
the controller over them and prints its endpoint. It supervises meanwhile: when its parent goes away
(stdin closes) or it gets SIGTERM, it stops its children.
Each child also asks the kernel to kill it should the launcher die (PR_SET_PDEATHSIG), so a SIGKILL
anywhere up the chain leaves no orphan servers.
"""

import contextlib
import ctypes
import gc
import json
import logging
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from meshy.dataplane.config import DataPlaneConfig
from meshy.dataplane.security import SECRET_ENV, Credentials

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent or parent == 1:
        os._exit(1)  # the parent died before the request took effect


def _server_info(info: object) -> dict:
    return {"role": str(info.role.value), "id": info.id, "ip": info.ip, "ports": dict(info.ports)}


def _storage_unit(tq_storage: object, config: DataPlaneConfig, index: int) -> object:
    """One TransferQueue storage unit; with durable rows, over a log it first reads back."""
    unit = tq_storage.SimpleStorageUnit.__ray_actor_class__({})
    if config.keeps_rows:
        from meshy.dataplane.durable_storage import DurableUnitData

        path = Path(config.durable_dir) / f"storage-{index}.log"
        data = DurableUnitData(path, config.durable, config.durable_sync_s)
        unit.storage_data = data  # before any request: nobody knows the unit's address yet
        unit.restored = {"rows": data.active_key_count, "torn_bytes": data.torn_bytes, "log_bytes": data.log_bytes}
    return unit


def _fork_server(make: Callable[[], object], timeout_s: float) -> tuple[int, dict, dict | None]:
    """Fork a child that builds one server, reports its endpoint (and what it read back from disk, if
    anything) through a pipe, then serves forever."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            _die_with_parent()
            server = make()
            report = {"info": _server_info(server.get_zmq_server_info()), "restored": getattr(server, "restored", None)}
            os.write(write_end, (json.dumps(report) + "\n").encode())
        except BaseException:
            os.write(write_end, (json.dumps({"error": traceback.format_exc()}) + "\n").encode())
            os._exit(1)
        os.close(write_end)
        while True:
            signal.pause()
    os.close(write_end)
    data = b""
    deadline = time.monotonic() + timeout_s
    with os.fdopen(read_end, "rb") as pipe:
        while not data.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([pipe], [], [], remaining)[0]:
                raise RuntimeError(f"server process {pid} did not report its endpoint within {timeout_s}s")
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"server process {pid} exited before reporting its endpoint")
            data += chunk
    report = json.loads(data)
    if "error" in report:
        raise RuntimeError(f"server process {pid} failed to start:\n{report['error']}")
    return pid, report["info"], report["restored"]


def _stop(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 3.0
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        for pid in list(alive):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    alive.discard(pid)
            except ChildProcessError:
                alive.discard(pid)
        time.sleep(0.02)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _controller_request(buffered: bytes) -> tuple[dict | None, bytes]:
    """The first whole line of `buffered` (a JSON request from the host process), and what follows it."""
    if b"\n" not in buffered:
        return None, buffered
    line, rest = buffered.split(b"\n", 1)
    return json.loads(line), rest


def main() -> None:
    config = DataPlaneConfig(**json.loads(sys.argv[1]))
    secret = bytes.fromhex(os.environ.pop(SECRET_ENV))
    _die_with_parent()
    logging.getLogger("transfer_queue").setLevel(logging.WARNING)
    creds = Credentials.from_secret(secret, config.encrypted)

    import torch
    import transfer_queue.storage.simple_storage as tq_storage

    from meshy.dataplane.controller import MeshyController
    from meshy.dataplane.security import secure_transfer_queue_servers

    secure_transfer_queue_servers(config.host, creds)
    # Storage units only move bytes. TransferQueue re-tunes torch's thread pool around every request
    # (reading the CPU topology each time, ~0.5 ms, and warning on small hosts); pin it once instead.
    torch.set_num_threads(1)
    tq_storage.limit_pytorch_auto_parallel_threads = lambda **_: contextlib.nullcontext()
    pids: list[int] = []
    try:
        storage, restored = [], []
        for i in range(config.num_storage_units):
            pid, info, kept = _fork_server(lambda i=i: _storage_unit(tq_storage, config, i), config.start_timeout_s)
            pids.append(pid)
            storage.append(info)
            restored.append(kept)
    except BaseException as e:
        _stop(pids)
        print(json.dumps({"error": str(e)}), flush=True)
        sys.exit(1)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    pid_report = {"launcher": os.getpid(), "storage": list(pids)}
    print(json.dumps({"storage": storage, "pids": pid_report, "restored": restored}), flush=True)
    running = list(pids)  # reaped ones leave: their pids may soon belong to unrelated processes
    buffered = b""
    try:
        while True:
            readable = select.select([sys.stdin], [], [], 1.0)[0]
            if readable:
                data = os.read(sys.stdin.fileno(), 4096)
                if not data:
                    return  # the host process is gone or asked us to stop
                request, buffered = _controller_request(buffered + data)
                if request is not None:  # the whole run's storage units are known: serve them
                    try:
                        pid, controller, kept = _fork_server(
                            lambda r=request: MeshyController(r["storage"], creds, config), config.start_timeout_s
                        )
                    except RuntimeError as e:
                        print(json.dumps({"error": str(e)}), flush=True)
                        return
                    running.append(pid)
                    print(json.dumps({"controller": controller, "pid": pid, "restored": kept}), flush=True)
            for pid in list(running):
                try:
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        running.remove(pid)
                        print(f"meshy data plane: server process {pid} exited", file=sys.stderr, flush=True)
                except ChildProcessError:
                    running.remove(pid)
    finally:
        _stop(running)
        gc.freeze()  # no final collection over torch's heap at exit: ~1 s of CPU, and the host waits for it


if __name__ == "__main__":
    main()
