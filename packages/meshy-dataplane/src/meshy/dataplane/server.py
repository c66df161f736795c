"""Starting and stopping the data-plane servers from the process that hosts them."""

import json
import os
import secrets
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import IO, Any

from meshy.dataplane.config import DataPlaneConfig
from meshy.dataplane.endpoints import STORE_KEY, Endpoints
from meshy.dataplane.errors import SchemaError, ServerUnavailable
from meshy.dataplane.security import MIN_SECRET_BYTES, SECRET_ENV


def new_secret() -> bytes:
    """A fresh per-run secret."""
    return secrets.token_bytes(32)


def secret_from_env() -> bytes:
    """The run secret from MESHY_DATAPLANE_SECRET (hex), as `meshy run` sets it for every rank."""
    value = os.environ.get(SECRET_ENV)
    if not value:
        raise SchemaError(f"{SECRET_ENV} is not set; every process of a run needs the run's secret")
    return parse_secret(value, SECRET_ENV)


def parse_secret(text: str, source: str, hint: str = "") -> bytes:
    """A run secret written as hex, from `source` (named in the error, followed by `hint`)."""
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise SchemaError(f"{source}: expected hex, got {len(text)} characters that are not{hint}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise SchemaError(f"{source}: expected at least {MIN_SECRET_BYTES} bytes{hint}")
    return secret


class DataPlaneServer:
    """The data-plane server processes one host runs: its storage units and, on one host of the run, the
    controller (`endpoints` is then set). Single-host runs start both at once (`start`); a run over
    several nodes starts every node's storage units (`start_storage`), then the controller over all of
    them on one node (`start_controller`).

    They stop when `shutdown` is called, when this object's process exits, or when it is killed.
    """

    def __init__(
        self,
        process: subprocess.Popen,
        config: DataPlaneConfig,
        storage: list[dict],
        pids: dict[str, Any],
        restored: list[dict | None],
    ):
        self._process = process
        self.config = config
        self.storage = storage  # this host's storage units, as TransferQueue describes servers
        self.pids = pids
        self.endpoints: Endpoints | None = None
        # What the servers read back from their logs (config.durable): per storage unit, then "controller".
        self.restored: dict[str, Any] = {"storage": restored, "controller": None}

    @classmethod
    def start(cls, secret: bytes, config: DataPlaneConfig | None = None, log: IO | None = None) -> "DataPlaneServer":
        """The controller and the storage units, all on this host."""
        server = cls.start_storage(secret, config, log)
        server.start_controller(server.storage)
        return server

    @classmethod
    def start_storage(
        cls,
        secret: bytes,
        config: DataPlaneConfig | None = None,
        log: IO | None = None,
        meanwhile: Callable[[], object] | None = None,
    ) -> "DataPlaneServer":
        """This host's `config.num_storage_units` storage units, bound to `config.host`. `meanwhile` runs
        here while the servers start (they take seconds to import TransferQueue)."""
        config = config or DataPlaneConfig()
        if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
            raise SchemaError(f"DataPlaneServer.start: secret must be at least {MIN_SECRET_BYTES} bytes")
        process = subprocess.Popen(
            [sys.executable, "-m", "meshy.dataplane.launcher", json.dumps(asdict(config))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, SECRET_ENV: secret.hex()},
        )
        try:
            if meanwhile is not None:
                meanwhile()
        except BaseException:
            process.kill()
            process.wait()
            raise
        report = _report(process, config.start_timeout_s, "storage")
        return cls(process, config, report["storage"], report["pids"], report.get("restored", []))

    def start_controller(self, storage: list[dict], nodes: list[int] | None = None) -> Endpoints:
        """Start the controller here, over the run's storage units (this host's among them) on `nodes`
        (the node of each unit; None: all on this one). Rows are routed by position in `storage`."""
        nodes = [0] * len(storage) if nodes is None else list(nodes)
        if len(nodes) != len(storage):
            raise SchemaError(f"start_controller: {len(nodes)} nodes for {len(storage)} storage units")
        self._process.stdin.write((json.dumps({"storage": storage}) + "\n").encode())
        self._process.stdin.flush()
        report = _report(self._process, self.config.start_timeout_s, "controller")
        self.pids["controller"] = report["pid"]
        self.restored["controller"] = report.get("restored")
        self.endpoints = Endpoints(report["controller"], tuple(storage), self.config.encrypted, tuple(nodes))
        return self.endpoints

    def publish(self, store: Any, key: str = STORE_KEY) -> None:
        if self.endpoints is None:
            raise SchemaError("publish: no controller runs on this host (start_controller first)")
        self.endpoints.publish(store, key)

    def alive(self) -> bool:
        return self._process.poll() is None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process.stdout.close()

    def __enter__(self) -> "DataPlaneServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _report(process: subprocess.Popen, timeout_s: float, expected: str) -> dict:
    """The launcher's next JSON line, which must carry `expected`; otherwise it is stopped and why is raised."""
    line = _read_line(process.stdout, timeout_s)
    report = json.loads(line) if line else {}
    if expected in report:
        return report
    code = process.poll()
    process.kill()
    process.wait()
    why = report.get("error") or (
        f"the launcher exited with code {code} (its stderr says why)"
        if code is not None
        else f"no report within start_timeout_s={timeout_s}"
    )
    raise ServerUnavailable(f"the data-plane servers did not start: {why}")


def _read_line(stream: IO[bytes], timeout_s: float) -> bytes:
    deadline = time.monotonic() + timeout_s
    data = b""
    fd = stream.fileno()
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return data
