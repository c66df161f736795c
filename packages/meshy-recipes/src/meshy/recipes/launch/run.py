"""`meshy run`: validate a recipe, make its run directory, start exactly one torchrun on this node.

One node: `torchrun --standalone`. Several: the same command on every node with its --node-rank;
node 0 hosts the rendezvous store (meshy.recipes.launch.cluster), the nodes agree on the run directory and
probe it if the run needs it shared (meshy.recipes.launch.shared_dir), then each starts torchrun's c10d
rendezvous with its own processes, watches the other nodes while it runs, and stops its own when
another fails. Every node then prints which rank died and the one command that resumes the run.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from meshy.dataplane import SchemaError
from meshy.dataplane.security import SECRET_ENV
from meshy.recipes.launch.cluster import SILENT, Cluster, parse_endpoint
from meshy.recipes.launch.durable_rows import discard_rows
from meshy.recipes.launch.nodes import (
    INTERFACE_ENVS,
    NODE_ADDRESS_ENV,
    NODE_RANK_ENV,
    RUN_DIR_ENV,
    STALL_REPORT,
    interface_of,
    node_address,
)
from meshy.recipes.launch.parent_death import die_with_parent
from meshy.recipes.launch.run_secret import run_secret
from meshy.recipes.launch.shared_dir import probe, shared_reasons
from meshy.recipes.launch.startup import mark_start
from meshy.recipes.launch.torchrun_output import RootCause, TorchrunOutput, exit_status
from meshy.recipes.recipe import DEFAULT_RECIPE, Recipe, load_recipe
from meshy.recipes.recipe.catalog import check_nodes
from meshy.recipes.recipe.overrides import Override, recipe_as_run
from meshy.recipes.recipe.topology import Slot, assign, on_node
from meshy.recipes.usercode.imports import CODE_PATH_ENV, code_path, import_beside, record_code_dirs
from meshy.recipes.usercode.task_errors import TASK_ERROR_ADVICE, TASK_ERROR_FILE
from meshy.recipes.usercode.task_trial import try_task
from meshy.train import checkpoint

RECIPE_FILE = "recipe.toml"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TORCHRUN_REPORT = "torchrun.txt"  # under the run's logs/: torchrun's own report of a failure
STOP_GRACE_S = 30.0  # after asking this node's torchrun to stop, how long before it is killed
BEAT_S = 0.5


def run(
    recipe_path: str | None,
    resume: str | None = None,
    nnodes: int | None = None,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    secret_file: str | None = None,
    overrides: Sequence[Override] = (),
) -> int:
    mark_start()
    if resume is not None:
        source = Path(resume) / RECIPE_FILE
        if not source.is_file():
            raise SchemaError(f"--resume {resume}: not a run directory (no {RECIPE_FILE})")
        if overrides:
            raise SchemaError(
                f"--set with --resume: a run carries on with the recipe it started with ({source}, overrides "
                "included); start a new run to change it"
            )
    else:
        source = Path(recipe_path) if recipe_path else DEFAULT_RECIPE
    recipe = load_recipe(source, overrides)  # every error surfaces here, before any process starts
    text = recipe_as_run(source, overrides)
    check_nodes(recipe, nnodes)
    import_beside(source)
    for note in try_task(recipe):  # the task's code on a few problems, against the model
        print(f"meshy: {note}", file=sys.stderr)
    os.environ[CODE_PATH_ENV] = code_path(source, os.environ)  # the ranks import the task as this process did
    secret = run_secret(secret_file, recipe.topology.nodes)
    if recipe.topology.nodes == 1:
        if node_rank or rdzv_endpoint:
            raise SchemaError("--node-rank, --rdzv-endpoint: the recipe runs on one node (topology.nodes = 1)")
        if resume:
            directory = Path(resume)
        else:
            directory = new_run_dir(recipe, text, time.strftime("%Y%m%d-%H%M%S"), False)
            record_code_dirs(directory, source)
        return run_one_node(recipe, directory, secret)
    if node_rank is None or rdzv_endpoint is None:
        raise SchemaError(
            f"a run over {recipe.topology.nodes} nodes (topology.nodes) needs --node-rank and --rdzv-endpoint "
            "HOST:PORT (node 0's address), the same on every node but for its own --node-rank"
        )
    if not 0 <= node_rank < recipe.topology.nodes:
        raise SchemaError(f"--node-rank {node_rank}: expected 0 to {recipe.topology.nodes - 1}")
    node = NodeRun(recipe, node_rank, rdzv_endpoint, secret, secret_file)
    return node.run(node.prepare(text, resume))


def new_run_dir(recipe: Recipe, text: bytes, stamp: str, shared: bool) -> Path:
    """runs/<name>-<stamp>, holding the recipe as run (`text`: meshy.recipes.recipe.overrides.recipe_as_run). shared:
    the nodes of one run may all make it (on a shared filesystem each writes the same bytes, replacing the
    file whole)."""
    directory = Path(recipe.run_dir) / f"{recipe.name}-{stamp}"
    directory.mkdir(parents=True, exist_ok=shared)
    partial = directory / f".{RECIPE_FILE}.{os.getpid()}"
    partial.write_bytes(text)
    partial.replace(directory / RECIPE_FILE)
    return directory


def run_one_node(recipe: Recipe, directory: Path, secret: bytes) -> int:
    announce(recipe, directory)
    env = {**os.environ, SECRET_ENV: secret.hex(), RUN_DIR_ENV: str(directory.resolve())}
    command = [*TORCHRUN, "--standalone", f"--nproc-per-node={recipe.world_size}", *rank_module(directory)]
    torchrun = Torchrun(command, env)
    output = TorchrunOutput(torchrun.process, directory / "logs" / TORCHRUN_REPORT)
    code = torchrun.process.wait()
    root = output.finish()
    if code == 0:
        discard_rows(recipe, directory, 0)
    else:
        slots = assign(recipe, recipe.world_size)
        cause = torchrun.stopped_by or failure(0, on_node(slots, 0), code, root)
        print(stopped_report(recipe, directory, code, [cause]), file=sys.stderr)
    return code


class Torchrun:
    """This node's torchrun, which never outlives `meshy run`: SIGINT or SIGTERM to meshy run asks it to
    stop its ranks (it exits, and meshy run says how to resume), and if meshy run dies without a word
    (SIGKILL) the kernel kills torchrun, whose ranks die with it (meshy.recipes.launch.parent_death)."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.stopped_by: str | None = None  # why meshy run stopped it, if it did
        # What torchrun gives each rank anyway, given here so that it prints no banner saying so (a rank sets
        # its own thread count: meshy.recipes.launch.cpu_threads); a user's own setting stands.
        env = {"OMP_NUM_THREADS": "1", **env}
        self.process = subprocess.Popen(
            command, env=env, stderr=subprocess.PIPE, text=True, errors="replace", preexec_fn=die_with_parent
        )
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._stop)

    def _stop(self, signum: int, _frame: object) -> None:
        self.stopped_by = f"meshy run was sent {signal.Signals(signum).name} and stopped torchrun and its ranks"
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)


class NodeRun:
    """This node's part of a multi-node run: agree with the other nodes, run torchrun, watch them all."""

    def __init__(self, recipe: Recipe, node: int, endpoint: str, secret: bytes, secret_file: str | None):
        self.recipe, self.node, self.endpoint, self.secret = recipe, node, endpoint, secret
        self.resume_flags = f" --nnodes {recipe.topology.nodes} --node-rank {node} --rdzv-endpoint {endpoint}"
        if secret_file is not None:
            self.resume_flags += f" --secret-file {secret_file}"
        layout_gpus = recipe.topology.gpus_per_node or 0
        self.slots = assign(recipe, recipe.world_size, gpus_per_node=layout_gpus)
        self.here = on_node(self.slots, node)
        self.cluster = Cluster(endpoint, node, recipe.topology.nodes)

    def prepare(self, text: bytes, resume: str | None) -> Path:
        """The run directory every node agreed on (made here for a new run), probed if it must be shared."""
        try:
            self.cluster.join(text.decode())
            if resume is not None:
                directory = Path(resume)
                names = self.cluster.agree("resume", directory.name)
                if len(set(names)) > 1:
                    raise SchemaError(f"--resume: the nodes resume different runs: {names} (node by node)")
            else:
                stamp = self.cluster.decided("run", time.strftime("%Y%m%d-%H%M%S"))
                directory = new_run_dir(self.recipe, text, stamp, True)
            reasons = shared_reasons(self.recipe, self.slots)
            if reasons:
                probe(self.cluster, directory, reasons)
        except SchemaError as e:
            with contextlib.suppress(dist.DistError):
                self.cluster.refuse(str(e))
            raise
        return directory

    def run(self, directory: Path) -> int:
        announce(self.recipe, directory, self.node)
        host, _ = parse_endpoint(self.endpoint)
        address = node_address(self.recipe, self.node, host)
        env = {
            **os.environ,
            SECRET_ENV: self.secret.hex(),
            RUN_DIR_ENV: str(directory.resolve()),
            NODE_RANK_ENV: str(self.node),
            NODE_ADDRESS_ENV: address,
        }
        interface = interface_of(address)
        for name in INTERFACE_ENVS:  # collectives between nodes use the node's interface, unless told otherwise
            if interface is not None and name not in env:
                env[name] = interface
        command = [
            *TORCHRUN,
            f"--nnodes={self.recipe.topology.nodes}",
            f"--nproc-per-node={len(self.here)}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={directory.name}",
            "--rdzv-conf=is_host=false",  # node 0's meshy run hosts the store
            f"--local-addr={address}",
            "--max-restarts=0",
            *rank_module(directory),
        ]
        torchrun = Torchrun(command, env)
        process = torchrun.process
        output = TorchrunOutput(process, directory / "logs" / TORCHRUN_REPORT)
        stopped, stop_asked = None, 0.0
        while process.poll() is None:
            reason = self.cluster.beat() if stopped is None else None
            if reason is not None:
                stopped, stop_asked = reason, time.monotonic()
                print(f"meshy: node {self.node}: {reason}; stopping this node's ranks", file=sys.stderr, flush=True)
                process.terminate()
            elif stopped is not None and time.monotonic() - stop_asked > STOP_GRACE_S:
                process.kill()
            time.sleep(BEAT_S)
        code, root = process.returncode, output.finish()
        if stopped is not None:
            failed, cause, message = True, False, f"stopped its ranks: {stopped}"
        else:
            failed = cause = code != 0
            message = (torchrun.stopped_by or failure(self.node, self.here, code, root)) if failed else "finished"
        newest = checkpoint.latest(directory / "checkpoints")
        with contextlib.suppress(dist.DistError):
            self.cluster.post(failed, cause, message, newest.name if newest is not None else None)
        # Node 0 hosts the store: it stays until every node has said how it ended.
        statuses = self.cluster.statuses(timeout_s=120.0 if self.node == 0 else 10.0)
        if not failed and all(s is not None and not s["failed"] for s in statuses.values()):
            discard_rows(self.recipe, directory, self.node)
            return 0
        causes = sorted(
            ((n, s) for n, s in statuses.items() if s is not None and s["cause"]), key=lambda item: item[1]["time"]
        )
        reports = [f"node {n}: {s['message']}" for n, s in causes] or [f"node {self.node}: {message}"]
        reports += [f"node {n} {SILENT}" for n, s in statuses.items() if s is None and n != self.node]
        saved = (statuses.get(0) or {}).get("checkpoint")  # node 0's trainer keeps the checkpoints
        text = stopped_report(self.recipe, directory, code, reports, self.resume_flags, saved, self.node)
        print(text, file=sys.stderr, flush=True)
        return code or 1


def announce(recipe: Recipe, directory: Path, node: int | None = None) -> None:
    where = "" if node is None else f" on {recipe.topology.nodes} nodes (this is node {node})"
    roles = ", ".join(f"{name} x{spec.processes}" for name, spec in recipe.roles.items())
    print(
        f"meshy: {recipe.name}: {recipe.world_size} processes ({roles}){where}, run directory {directory}", flush=True
    )
    for report in (STALL_REPORT, TASK_ERROR_FILE):  # a resumed run's own, if any, only
        (directory / "logs" / report).unlink(missing_ok=True)


def rank_module(directory: Path) -> list[str]:
    return ["-m", "meshy.recipes.launch", str((directory / RECIPE_FILE).resolve())]


def failure(node: int, here: list[Slot], code: int, root: RootCause | None) -> str:
    """What ended this node's torchrun, as the recipe's processes: the rank that died first and how."""
    if code < 0:
        ranks = ", ".join(f"{s.rank} {s.role}-{s.index}" for s in here)
        return f"its torchrun agent was {exit_status(code)}, and its ranks ({ranks}) with it"
    if root is not None and root.local_rank < len(here):
        slot = here[root.local_rank]
        return f"rank {slot.rank} ({slot.role}-{slot.index} on node {node}) failed first: {root.describe()}"
    return f"torchrun ended with {exit_status(code)}"


def stopped_report(
    recipe: Recipe,
    directory: Path,
    code: int,
    causes: list[str],
    resume_flags: str = "",
    saved: str | None = None,
    node: int = 0,
) -> str:
    """What a user needs after a run stopped early: which rank died, where the logs are, how to carry on.
    saved: the newest checkpoint's name where the trainer keeps it (None: this node's own). A run stopped by
    the task's own code gets that error and no resume advice: a resume would fail the same way."""
    task_error = directory / "logs" / TASK_ERROR_FILE
    if task_error.is_file():
        return (
            f"meshy: run {directory} stopped: the task's code failed (torchrun exit code {code})\n"
            f"meshy: {task_error.read_text().rstrip()}\nmeshy: {TASK_ERROR_ADVICE}.\n"
            f"meshy: logs in {directory / 'logs'}."
        )
    if saved is None:
        newest = checkpoint.latest(directory / "checkpoints")
        saved = newest.name if newest is not None else None
    since = f"its newest checkpoint, {saved}" if saved is not None else "the start (no checkpoint yet)"
    stall = directory / "logs" / STALL_REPORT
    stalled = f"; it stalled (what each task waited for: {stall})" if stall.is_file() else ""
    where = "" if not resume_flags else f" on every node (each with its own --node-rank; this is node {node})"
    return (
        f"meshy: run {directory} stopped before finishing (torchrun exit code {code}){stalled}"
        + "".join(f"\nmeshy: {c}" for c in causes)
        + f"\nmeshy: logs in {directory / 'logs'}.\n"
        f"meshy: continue from {since}{where} with: meshy run --resume {directory}{resume_flags}"
    )
