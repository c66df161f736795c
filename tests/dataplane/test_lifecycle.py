"""Server processes: how they start, what they listen on, who may talk to them, and how they die."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import zmq
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType, format_zmq_address

from meshy.dataplane import (
    AccessDenied,
    Column,
    DataPlaneClient,
    DataPlaneConfig,
    DataPlaneServer,
    ServerUnavailable,
    TableSpec,
    new_secret,
)
from tests.dataplane import workers

REPO = Path(__file__).resolve().parents[2]


def server_pids(pids: dict) -> list[int]:
    return [pids["launcher"], pids["controller"], *pids["storage"]]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not gone(p)]


def test_servers_are_plain_processes_on_loopback_without_ray(dataplane):
    import ray

    launcher = psutil.Process(dataplane.pids["launcher"])
    children = {p.pid for p in launcher.children(recursive=True)}
    assert children == {dataplane.pids["controller"], *dataplane.pids["storage"]}
    for pid in server_pids(dataplane.pids):
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                assert conn.laddr.ip == "127.0.0.1", f"process {pid} listens on {conn.laddr}"
    ray_processes = [
        p.info["name"] for p in psutil.process_iter(["name", "cmdline"]) if _looks_like_ray(p.info["cmdline"] or [])
    ]
    assert ray_processes == []
    assert not ray.is_initialized()


def _looks_like_ray(cmdline: list[str]) -> bool:
    return any(part.endswith(("raylet", "gcs_server")) or part.startswith("ray::") for part in cmdline)


def test_a_dead_server_fails_calls_at_once_not_at_the_reply_deadline(secret):
    """Process death closes the connection; no call waits out rpc_timeout_s (30 s by default) for it."""
    config = DataPlaneConfig(num_storage_units=2)
    assert config.rpc_timeout_s >= 30
    with DataPlaneServer.start(secret, config) as server, DataPlaneClient(server.endpoints, secret, config) as client:
        client.create_table(TableSpec("t", (Column("x", "int64"),)))
        client.put("t", [0, 1], {"x": torch.tensor([0, 1])})

        os.kill(server.pids["storage"][1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(
            ServerUnavailable,
            match=r"storage unit TQ_STORAGE_UNIT_\w+ at tcp://127.0.0.1:\d+ closed its connection",
        ):
            client.lease("t", "train", ["x"], count=2, timeout=5)
        assert time.monotonic() - t0 < 3.0
        t0 = time.monotonic()
        with pytest.raises(ServerUnavailable, match=r"storage unit \w+ at .* closed its connection earlier"):
            client.put("t", [2, 3], {"x": torch.tensor([2, 3])})
        assert time.monotonic() - t0 < 2.0

        os.kill(server.pids["controller"], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(
            ServerUnavailable, match=r"controller at tcp://127.0.0.1:\d+ closed its connection.*'lease'"
        ):
            client.lease("t", "infer", ["x"], timeout=60)
        assert time.monotonic() - t0 < 3.0
        t0 = time.monotonic()
        with pytest.raises(ServerUnavailable, match="closed its connection earlier; 'append' was not sent"):
            client.append("weights", {"version": 1})
        assert time.monotonic() - t0 < 2.0


def test_a_server_that_stalls_for_seconds_is_waited_for_not_declared_dead(secret):
    """A loaded host can stall a healthy server for seconds (a 5 s reply bound once killed every role of a
    run beside a CI job); paused for 7 s, the controller and a storage unit answer late and nothing fails."""
    config = DataPlaneConfig(num_storage_units=2)
    with DataPlaneServer.start(secret, config) as server, DataPlaneClient(server.endpoints, secret, config) as client:
        client.create_table(TableSpec("t", (Column("x", "int64"),)))
        client.put("t", [0, 1], {"x": torch.tensor([10, 11])})
        paused = [server.pids["controller"], server.pids["storage"][1]]
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            resume = threading.Timer(7.0, lambda: [os.kill(pid, signal.SIGCONT) for pid in paused])
            resume.start()
            batch = client.lease("t", "train", ["x"], count=2, timeout=30)
        finally:
            resume.join()
            for pid in paused:
                os.kill(pid, signal.SIGCONT)
        assert time.monotonic() - t0 >= 6.5
        assert torch.equal(batch.columns["x"], torch.tensor([10, 11]))
        assert client.ack(batch).acked == [0, 1]


def test_shutdown_and_killing_the_host_leave_no_server_processes(secret, mp_context, tmp_path):
    with DataPlaneServer.start(secret) as server:
        pids = server_pids(server.pids)
    assert wait_gone(pids, 5.0) == []

    host = mp_context.Process(target=workers.host_dataplane, args=(secret, str(tmp_path / "pids.json")))
    host.start()
    deadline = time.monotonic() + 60
    while not (tmp_path / "pids.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.05)
    pids = server_pids(json.loads((tmp_path / "pids.json").read_text()))
    assert not any(gone(p) for p in pids)
    os.kill(host.pid, signal.SIGKILL)
    host.join()
    assert wait_gone(pids, 5.0) == [], "orphaned data-plane server processes"


def test_work_done_while_the_servers_start_overlaps_their_start_and_its_failure_leaves_no_server(secret):
    """`meanwhile` runs once the launcher is a process of this one (and before it reported)."""
    before = {p.pid for p in psutil.Process().children()}
    ran = []
    with DataPlaneServer.start_storage(secret, meanwhile=lambda: ran.append(psutil.Process().children())) as server:
        assert server.storage and server.pids["launcher"] in {p.pid for p in ran[0]}

    def fails() -> None:
        started.extend(p for p in psutil.Process().children() if p.pid not in before)
        raise KeyError("the role's module")

    started = []
    with pytest.raises(KeyError, match="the role's module"):
        DataPlaneServer.start_storage(secret, meanwhile=fails)
    assert len(started) == 1 and wait_gone([started[0].pid], 5.0) == [], "the launcher outlived the failure"


def test_a_client_without_the_secret_is_refused(dataplane):
    t0 = time.monotonic()
    with pytest.raises(AccessDenied, match="refused this client's credentials"):
        DataPlaneClient(dataplane.endpoints, new_secret(), DataPlaneConfig(rpc_timeout_s=1.0))
    assert time.monotonic() - t0 < 2.0


class _Exploit:
    """Unpickling this creates a file: what an attacker would send to a TransferQueue socket."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_unauthenticated_bytes_never_reach_server_code(dataplane, tmp_path):
    marker = tmp_path / "pwned"
    frames = ZMQMessage.create(ZMQRequestType.GET_META, "attacker", {"x": _Exploit(marker)}).serialize()
    ZMQMessage.deserialize(frames)  # the payload is live: decoding it runs code
    assert marker.exists()
    marker.unlink()

    ctx = zmq.Context()
    targets = [dataplane.endpoints.controller["ports"]["request_handle_socket"]]
    targets += [unit["ports"]["put_get_socket"] for unit in dataplane.endpoints.storage]
    sent = {}
    try:
        for port in targets:  # every port gets the payload first, then a second to answer (together, not in turn)
            sock = sent[port] = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.identity = b"TQ_STORAGE_attacker"  # even with the identity storage units expect
            sock.connect(format_zmq_address("127.0.0.1", port))
            sock.send_multipart([bytes(f) for f in frames])
        deadline = time.monotonic() + 1.0
        for port, sock in sent.items():
            wait_ms = max(0, round((deadline - time.monotonic()) * 1000))
            assert not sock.poll(wait_ms), f"port {port} answered an unauthenticated peer"
    finally:
        for sock in sent.values():
            sock.close()
        ctx.term()
    assert not marker.exists()


def test_encrypted_transport_works_and_refuses_strangers(secret):
    config = DataPlaneConfig(encrypt=True, rpc_timeout_s=2.0)
    with DataPlaneServer.start(secret, config) as server:
        assert server.endpoints.encrypted
        with DataPlaneClient(server.endpoints, secret, config) as client:
            client.create_table(TableSpec("t", (Column("x", "float32", (8,)),)))
            client.put("t", [0], {"x": torch.ones(1, 8)})
            assert torch.equal(client.lease("t", "train", ["x"], timeout=5).columns["x"], torch.ones(1, 8))
        with pytest.raises(AccessDenied):
            DataPlaneClient(server.endpoints, new_secret(), config)


def test_ranks_under_torchrun_find_the_data_plane_through_the_store_and_consume_disjoint_rows(tmp_path):
    env = {**os.environ, "MESHY_DATAPLANE_SECRET": new_secret().hex(), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    cmd += [str(REPO / "tests" / "dataplane" / "rank_consumer.py"), str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    rows = [r for groups in per_rank for group in groups for r in group]
    assert sorted(rows) == list(range(90)), "every row reached exactly one rank"
    assert all(groups for groups in per_rank), "every rank consumed directly"
    for groups in per_rank:
        assert all(len(g) == 3 and len({r // 3 for r in g}) == 1 for g in groups), "whole groups only"


def test_the_controller_still_answers_transferqueue_requests_and_tables_are_its_partitions(client, unique, dataplane):
    """TransferQueue's own protocol is served on the same socket, to peers that hold the secret."""
    table = client.create_table(TableSpec(unique("tq"), (Column("x", "int64"),))).name
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        client._creds.secure_client(sock)
        sock.connect(client._controller_address)
        request = ZMQMessage.create(ZMQRequestType.GET_LIST_PARTITIONS, "raw-tq-client", {})
        sock.send_multipart(request.serialize())
        assert sock.poll(5000)
        reply = ZMQMessage.deserialize(sock.recv_multipart())
        sock.close()
    finally:
        ctx.term()
    assert reply.request_type == ZMQRequestType.LIST_PARTITIONS_RESPONSE
    assert table in reply.body["partition_ids"]
