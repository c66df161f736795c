"""Runs over two nodes, simulated on this machine: two `meshy run --nnodes 2` invocations on loopback, each
with its own torchrun agent (c10d rendezvous at node 0's meshy run), real processes throughout."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshy.dataplane import SchemaError
from meshy.dataplane.security import SECRET_ENV
from meshy.recipes.launch.cluster import Cluster
from meshy.recipes.launch.run_secret import run_secret
from meshy.recipes.launch.shared_dir import probe
from meshy.recipes.observe.inspect_run import report
from tests.recipes.test_default_run import per_version
from tests.recipes.test_faults import children, victim_pid
from tests.recipes.test_pipeline import REPO, check_run, checkpointed, kill_tree, small_recipe

COMMAND = [sys.executable, "-m", "meshy.recipes.cli", "run"]
STOP_WITHIN_S = 60  # the promise: every node stops within a minute of a death on any node
STEPS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split(text: str) -> str:
    """A recipe over two nodes: training on node 0, inference and rollout on node 1."""
    text = text.replace("[roles.inference]\nprocesses = 1\n", "[roles.inference]\nprocesses = 1\nnode = 1\n")
    return text + "\n[topology]\nnodes = 2\n"


def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.secret"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return path


class TwoNodes:
    """`meshy run` on node 0 and node 1 of one run (the same command but for --node-rank)."""

    def __init__(self, tmp_path: Path, port: int, args: list[str], cwds: tuple[Path, Path] | None = None):
        self.flags = [
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--secret-file",
            str(secret_file(tmp_path)),
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop(SECRET_ENV, None)
        self.nodes = [
            subprocess.Popen(
                [*COMMAND, *args, *self.flags, "--node-rank", str(node)],
                env=env,
                cwd=cwds[node] if cwds else None,
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for node in (0, 1)
        ]
        self.outputs: list[tuple[str, str]] = [("", "")] * 2
        self._readers = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in (0, 1)]
        for reader in self._readers:
            reader.start()

    def _read(self, i: int) -> None:
        self.outputs[i] = self.nodes[i].communicate()

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        return [node.poll() for node in self.nodes]

    def kill(self) -> None:
        for node in self.nodes:
            kill_tree(node)
            node.wait()


@pytest.fixture
def two_nodes():
    started: list[TwoNodes] = []

    def start(*args, **kwargs) -> TwoNodes:
        started.append(TwoNodes(*args, **kwargs))
        return started[-1]

    yield start
    for nodes in started:
        nodes.kill()


def test_a_run_over_several_nodes_without_a_shared_secret_is_refused_saying_how_to_make_one(tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(split(small_recipe(tmp_path, "1").read_text()))
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    command = [*COMMAND, str(recipe), "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:9"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "a run over 2 nodes needs the same secret on every node" in result.stderr
    assert "openssl rand -hex 32 > run.secret && chmod 600 run.secret" in result.stderr
    assert not list(tmp_path.glob("arithmetic-tiny-*")), "refused before anything was made"


def test_a_secret_file_must_be_hex_and_readable_by_its_owner_only(tmp_path):
    path = secret_file(tmp_path)
    assert run_secret(str(path), nodes=2) == bytes.fromhex(path.read_text())
    path.chmod(0o644)
    with pytest.raises(SchemaError, match=r"readable by others \(mode -rw-r--r--\); chmod 600"):
        run_secret(str(path), nodes=2)
    path.write_text("not hex")
    path.chmod(0o600)
    with pytest.raises(SchemaError, match="expected hex"):
        run_secret(str(path), nodes=2)


def on_nodes(call, ranks: tuple[int, ...] = (0, 1)) -> list:
    """`call(cluster)` on nodes `ranks` of one two-node run, with a fresh rendezvous store (threads of
    this process, a real TCP store); what each returned, or the SchemaError it raised."""
    port, results = free_port(), [None] * len(ranks)
    done = threading.Barrier(len(ranks), timeout=60)  # node 0's store stays up until every node is done

    def node(i: int) -> None:
        cluster = Cluster(f"127.0.0.1:{port}", ranks[i], 2)
        try:
            results[i] = call(cluster)
        except SchemaError as e:
            results[i] = e
        done.wait()

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(len(ranks))]
    for thread in threads:
        thread.start()
        time.sleep(0.2)  # node 0 hosts the store
    for thread in threads:
        thread.join(60)
    return results


def test_a_run_directory_the_other_node_cannot_see_is_refused_on_every_node(tmp_path):
    (tmp_path / "0").mkdir()
    (tmp_path / "1").mkdir()
    results = on_nodes(lambda c: probe(c, tmp_path / str(c.node), ['publish = "disk": inference on node 1']))
    for result in results:
        assert isinstance(result, SchemaError), result
        assert f"run directory {tmp_path}/" in str(result)
        assert "node 0 cannot see what node 1 writes there" in str(result)
        assert 'publish = "disk": inference on node 1. Put run_dir on a filesystem every node mounts' in str(result)
    assert not list(tmp_path.glob("*/.meshy-probe-*")), "the probes are cleaned up"
    assert on_nodes(lambda c: probe(c, tmp_path, ["shared"])) == [None, None], "a shared directory passes"


def test_two_nodes_with_one_node_rank_or_different_recipes_are_refused():
    twice = on_nodes(lambda c: c.join("recipe"), ranks=(0, 1, 1))
    assert [str(r) for r in twice if r is not None] == ["two nodes were started with --node-rank 1"], twice
    differ = on_nodes(lambda c: c.join(f"recipe of node {c.node}"))
    assert all("node 1 runs a different recipe than node 0" in str(r) for r in differ), differ


def long_split_recipe(tmp_path: Path, steps: int, checkpoint_every: int = 0) -> Path:
    recipe = small_recipe(tmp_path, "1", steps=steps)
    text = re.sub(r"^checkpoint_every = .*$", f"checkpoint_every = {checkpoint_every}", recipe.read_text(), flags=re.M)
    recipe.write_text(split(text))
    return recipe


def wait_for_version(nodes: TwoNodes, root: Path, version: int, checkpoint: bool = False) -> Path:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and all(n.poll() is None for n in nodes.nodes):
        metrics = next(root.glob("arithmetic-tiny-*/metrics.jsonl"), None)
        trained = metrics is not None and len(metrics.read_text().splitlines()) >= version
        if trained and (not checkpoint or checkpointed(metrics.parent)):
            return metrics.parent
        time.sleep(0.1)
    raise AssertionError(f"the run should still be going at version {version}: {nodes.outputs}")


def agent_of(nodes: TwoNodes, node: int) -> int:
    (agent,) = children(nodes.nodes[node].pid)
    return agent


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "died"),
    [
        ("agent-1", "node 1: its torchrun agent was killed by SIGKILL, and its ranks (1 inference-0, 2 rollout-0)"),
        ("inference-0", "node 1: rank 1 (inference-0 on node 1) failed first: killed by SIGKILL"),
        ("training-0", "node 0: rank 0 (training-0 on node 0) failed first: killed by SIGKILL"),
    ],
)
def test_a_death_on_one_node_stops_every_node_within_a_minute_and_the_run_resumes_on_both(
    tmp_path, two_nodes, target, died
):
    recipe = long_split_recipe(tmp_path, STEPS, checkpoint_every=2)
    port = free_port()
    nodes = two_nodes(tmp_path, port, [str(recipe)])
    run_dir = wait_for_version(nodes, tmp_path, 3, checkpoint=True)
    victim = agent_of(nodes, 1) if target == "agent-1" else victim_pid(run_dir, target)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    codes = nodes.wait(STOP_WITHIN_S + 30)
    assert None not in codes, f"every node stops (exit codes {codes}): {nodes.outputs}"
    assert time.monotonic() - killed_at < STOP_WITHIN_S
    assert all(code != 0 for code in codes), codes
    for node, (_, stderr) in enumerate(nodes.outputs):
        assert f"meshy: {died}" in stderr, stderr[-4000:]
        flags = f"--nnodes 2 --node-rank {node} --rdzv-endpoint 127.0.0.1:{port} --secret-file"
        resume = f"with: meshy run --resume {run_dir} {flags}"
        assert resume in stderr and "meshy: continue from its newest checkpoint, step-" in stderr, stderr[-3000:]
    restored = max(int(p.name.removeprefix("step-")) for p in (run_dir / "checkpoints").glob("step-*"))
    resumed = two_nodes(tmp_path, free_port(), ["--resume", str(run_dir)])
    codes = resumed.wait(600)
    assert codes == [0, 0], resumed.outputs
    check_run(run_dir, 0, resumed_at=restored, steps=STEPS)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("gone", "said"),
    [
        (1, "node 1 stopped answering (no heartbeat for 20 s): its meshy run, torchrun agent or machine is gone"),
        (0, "meshy run --resume"),  # node 1 notices the store, or its ranks the data plane, whichever first
    ],
)
def test_a_node_whose_meshy_run_vanishes_is_noticed_by_the_other_within_a_minute(tmp_path, two_nodes, gone, said):
    """SIGKILL one node's meshy run (its torchrun and ranks die with it, as with the machine): the node
    left stops on its own and says what to do."""
    recipe = long_split_recipe(tmp_path, 1_000_000)  # a run that cannot end by itself meanwhile
    nodes = two_nodes(tmp_path, free_port(), [str(recipe)])
    wait_for_version(nodes, tmp_path, 1)
    os.kill(nodes.nodes[gone].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    codes = nodes.wait(STOP_WITHIN_S + 30)
    left = 1 - gone
    assert codes[left] not in (None, 0), f"the node left stops, and not as a success: {codes}"
    assert time.monotonic() - killed_at < STOP_WITHIN_S
    assert said in nodes.outputs[left][1], nodes.outputs[left][1][-3000:]


@pytest.mark.slow
def test_a_run_directory_that_is_not_shared_is_refused_before_any_rank_starts(tmp_path, two_nodes):
    """publish = "disk" with inference on node 1: node 1 must read what training writes on node 0. A
    relative run_dir from two working directories is two directories."""
    recipe = long_split_recipe(tmp_path, STEPS)
    recipe.write_text(re.sub(r"^run_dir = .*$", 'run_dir = "runs"', recipe.read_text(), flags=re.M))
    cwds = (tmp_path / "node0", tmp_path / "node1")
    for cwd in cwds:
        cwd.mkdir()
    nodes = two_nodes(tmp_path, free_port(), [str(recipe)], cwds=cwds)
    assert nodes.wait(120) == [2, 2], nodes.outputs
    for _, stderr in nodes.outputs:
        assert "cannot see what node" in stderr and 'publish = "disk": inference on node 1 loads the weights' in stderr
        assert "torch.distributed.run" not in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_the_default_recipe_split_over_two_nodes_climbs_past_0_9_with_each_producer_writing_locally(
    tmp_path, two_nodes
):
    """The main job (the embedded default), training on node 0 and inference and rollout on node 1: the
    same reward criterion as on one node. Every row is written on node 1 and read by training from
    there; nothing is stored on node 0."""
    from meshy.recipes.recipe import DEFAULT_RECIPE, load_recipe

    recipe = tmp_path / "recipe.toml"
    text = re.sub(r"^run_dir = .*$", f'run_dir = "{tmp_path}"', DEFAULT_RECIPE.read_text(), flags=re.M)
    recipe.write_text(split(text))
    nodes = two_nodes(tmp_path, free_port(), [str(recipe)])
    assert nodes.wait(3000) == [0, 0], nodes.outputs
    (run_dir,) = tmp_path.glob("arithmetic-tiny-*")
    versions = per_version(run_dir)
    assert [v[0] for v in versions] == list(range(1, load_recipe().steps + 1))
    rewards = [v[2] for v in versions]
    start, end = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert start < 0.15 and end >= 0.9, (start, end)
    traffic = report(run_dir).split("data-plane bytes")[1].splitlines()
    print("\n".join(traffic))  # the figure on docs/nodes.md
    rows = {line.split(":")[0].strip(): line for line in traffic[1:] if "->" in line}
    assert rows["node 1 -> node 0"].endswith("sent 0 B, received 0 B"), "node 1's producers wrote locally"
    assert rows["node 0 -> node 0"].endswith("sent 0 B, received 0 B"), "nothing is stored on node 0"


@pytest.mark.slow
def test_plain_torchrun_on_each_node_runs_the_recipe_over_both(tmp_path):
    """The same run without `meshy run`: `torchrun --nnodes 2 --node-rank R ... -m meshy.recipes.launch.rank
    RECIPE` on each node (torchrun's static rendezvous), the secret in the environment. Each rank takes
    its node from torchrun's node rank; the run trains every version once."""
    recipe = long_split_recipe(tmp_path, STEPS)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), SECRET_ENV: os.urandom(32).hex()}
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                f"--nproc-per-node={processes}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--max-restarts=0",
                "-m",
                "meshy.recipes.launch.rank",
                str(recipe),
            ],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node, processes in ((0, 1), (1, 2))  # training on node 0; inference and rollout on node 1
    ]
    try:
        errors = [agent.communicate(timeout=300)[1] for agent in agents]
    finally:
        for agent in agents:
            kill_tree(agent)
    assert [agent.returncode for agent in agents] == [0, 0], [e[-3000:] for e in errors]
    run_dir = tmp_path / "arithmetic-tiny"
    check_run(run_dir, 0, steps=STEPS)
    traffic = report(run_dir).split("data-plane bytes")[1].splitlines()
    rows = {line.split(":")[0].strip(): line for line in traffic[1:] if "->" in line}
    assert rows["node 1 -> node 0"].endswith("sent 0 B, received 0 B"), "node 1's ranks are on node 1"
    assert not rows["node 0 -> node 1"].endswith("received 0 B"), "node 0's trainer read node 1's rows"
