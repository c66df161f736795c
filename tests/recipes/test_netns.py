"""Two nodes, each in its own network namespace with its own address on a veth pair (root and `ip netns`
needed; skipped, with the reason, where they are not permitted): the run finishes, every data-plane
server listens on its node's address (nothing on loopback), every byte between the nodes' data-plane
sockets is CURVE-encrypted, and a process on a node without the run's secret is refused."""

import ipaddress
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshy.dataplane import Endpoints
from tests.recipes.test_multinode import free_port, long_split_recipe, secret_file
from tests.recipes.test_pipeline import REPO, check_run, kill_tree, records

pytestmark = pytest.mark.slow

STEPS = 100  # long enough for the outsider to try while the run goes on
ADDRESSES = ("10.77.0.1", "10.77.0.2")
ZMTP_MECHANISM = slice(12, 32)  # the greeting's mechanism name, NUL-padded (ZMTP 3)
PLAINTEXT = (b"prompt_ids", b"response_ids", b"rollout")  # what an unencrypted data-plane message carries


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def namespaces():
    """Two network namespaces joined by a veth pair, node i at ADDRESSES[i]: (namespaces, interfaces)."""
    tag = os.getpid() % 100000
    names, links = (f"meshy{tag}n0", f"meshy{tag}n1"), (f"mv{tag}a", f"mv{tag}b")
    steps = [
        ("netns", "add", names[0]),
        ("netns", "add", names[1]),
        ("link", "add", links[0], "type", "veth", "peer", "name", links[1]),
    ]
    for i in (0, 1):
        steps += [
            ("link", "set", links[i], "netns", names[i]),
            ("-n", names[i], "addr", "add", f"{ADDRESSES[i]}/24", "dev", links[i]),
            ("-n", names[i], "link", "set", links[i], "up"),
            ("-n", names[i], "link", "set", "lo", "up"),
        ]
    try:
        for step in steps:
            done = ip(*step)
            if done.returncode != 0:
                pytest.skip(f"network namespaces are not permitted here: ip {' '.join(step)}: {done.stderr.strip()}")
        yield names, links
    finally:
        for name in names:
            ip("netns", "del", name)  # takes its end of the veth pair, and so the pair, with it


def in_namespace(name: str, *command: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(["ip", "netns", "exec", name, *command], env=env, start_new_session=True, **kwargs)


def listening(name: str) -> list[tuple[str, int]]:
    """Every TCP socket listening in the namespace: (address, port)."""
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        text = subprocess.run(["ip", "netns", "exec", name, "cat", f"/proc/net/{table}"], capture_output=True).stdout
        for line in text.decode().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":
                continue
            address, port = local.split(":")
            raw = bytes.fromhex(address)
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, width // 2, 4))  # host-order words
            host = ipaddress.ip_address(packed)
            if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped is not None:
                host = host.ipv4_mapped
            out.append((str(host), int(port, 16)))
    return out


def wait_for_first_version(root: Path, nodes: list[subprocess.Popen]) -> Path:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and all(n.poll() is None for n in nodes):
        metrics = next(root.glob("arithmetic-tiny-*/metrics.jsonl"), None)
        if metrics is not None and metrics.read_text().strip():
            return metrics.parent
        time.sleep(0.1)
    raise AssertionError("the run should be going")


def test_two_nodes_in_their_own_namespaces_listen_on_their_addresses_and_talk_only_curve(tmp_path, namespaces):
    names, links = namespaces
    recipe, secret = long_split_recipe(tmp_path, STEPS), secret_file(tmp_path)
    captured, stop = tmp_path / "captured", tmp_path / "stop-capture"
    capture = in_namespace(
        names[1], sys.executable, "-m", "tests.recipes.packet_capture", links[1], str(captured), str(stop)
    )
    # The outsider imports before the run starts and tries the moment the run is going (on a loaded host
    # its imports outlasted the run: it then found no server at all, not a refusal).
    outsider = in_namespace(
        names[1], sys.executable, "-c", OUTSIDER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    nodes: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 60
        while not (captured / "ready").exists():
            assert capture.poll() is None and time.monotonic() < deadline, "the capture should be running"
            time.sleep(0.1)
        flags = ["--nnodes", "2", "--rdzv-endpoint", f"{ADDRESSES[0]}:{free_port()}", "--secret-file", str(secret)]
        for node in (0, 1):
            command = [sys.executable, "-m", "meshy.recipes.cli", "run", str(recipe), *flags, "--node-rank", str(node)]
            nodes.append(in_namespace(names[node], *command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        run_dir = wait_for_first_version(tmp_path, nodes)
        sockets = [listening(name) for name in names]
        (start,) = [r for r in records(run_dir, "training-0") if r["kind"] == "start"]
        endpoints = Endpoints.from_json(start["endpoints"])
        refused = outsider.communicate((endpoints.to_json() + "\n").encode(), timeout=120)
        assert [node.poll() for node in nodes] == [None, None], "the outsider tried while the run went on"
        outputs = [node.communicate(timeout=600) for node in nodes]
        assert [node.returncode for node in nodes] == [0, 0], outputs
    finally:
        stop.touch()
        for process in (*nodes, capture, outsider):
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                kill_tree(process)
                process.wait()
    check_run(run_dir, 0, steps=STEPS)

    assert endpoints.encrypted, "off loopback every connection is CURVE"
    assert endpoints.controller["ip"] == ADDRESSES[0]
    assert [unit["ip"] for unit in endpoints.storage] == list(ADDRESSES) and endpoints.storage_nodes == (0, 1)
    for name in ("training-0", "inference-0", "rollout-0"):
        (started,) = [r for r in records(run_dir, name) if r["kind"] == "start"]
        assert started["address"] == ADDRESSES[started["node"]], started
    dataplane = {(endpoints.controller["ip"], port) for port in endpoints.controller["ports"].values()}
    dataplane |= {(unit["ip"], unit["ports"]["put_get_socket"]) for unit in endpoints.storage}
    for node, found in enumerate(sockets):
        assert not [s for s in found if ipaddress.ip_address(s[0]).is_loopback], f"node {node} listens on loopback"
        mine = {s for s in dataplane if s[0] == ADDRESSES[node]}
        assert mine and mine <= set(found), f"node {node}'s data-plane servers listen on its address: {found}"
        assert {s for s in found if s[0] not in ("0.0.0.0", "::")} == mine, "nothing else binds an address"

    assert outsider.returncode == 0 and refused[0].decode().strip() == "AccessDenied", refused

    data_ports = {port for _, port in dataplane}
    streams = {p: p.read_bytes() for p in captured.glob("*.bin")}
    between = {p: data for p, data in streams.items() if data_ports & set(map(int, re.findall(r"_(\d+)", p.stem)))}
    assert between, "data-plane traffic crossed between the nodes"
    raw = bytes.fromhex(secret.read_text())
    for path, data in streams.items():
        assert raw not in data and secret.read_text().strip().encode() not in data, f"the secret crossed in {path}"
    moved = 0
    for path, data in between.items():
        assert data[0] == 0xFF and data[9] == 0x7F, f"{path.stem} starts with a ZMTP greeting"
        assert data[ZMTP_MECHANISM].rstrip(b"\0") == b"CURVE", f"{path.stem}: {data[ZMTP_MECHANISM]}"
        assert not [marker for marker in PLAINTEXT if marker in data], f"{path.stem} carries plaintext"
        moved += len(data)
    print(f"data-plane bytes between the two nodes: {moved} in {len(between)} streams")


OUTSIDER = """
import os, sys
from meshy.dataplane import AccessDenied, DataPlaneClient, DataPlaneConfig, Endpoints
endpoints = Endpoints.from_json(sys.stdin.readline())
try:
    DataPlaneClient(endpoints, os.urandom(32), DataPlaneConfig(rpc_timeout_s=10.0))
except AccessDenied:
    print("AccessDenied")
else:
    print("connected")
"""
