"""Bodies of the processes the multi-process tests start (importable, so the forkserver preloads them)."""

import json
import time
from datetime import timedelta
from pathlib import Path

from meshy.dataplane import ON_DEMAND, DataPlaneClient, DataPlaneConfig, Endpoints, GpuTokenRing
from meshy.dataplane.rings import ledger_stream


def _client(endpoints: str, secret: bytes, name: str) -> DataPlaneClient:
    return DataPlaneClient(Endpoints.from_json(endpoints), secret, DataPlaneConfig(), name=name)


def ack_then_hold(endpoints: str, secret: bytes, table: str, task: str, ack_n: int, hold_n: int, out: str) -> None:
    """Process and ack some rows, then lease more and hang holding them until killed."""
    client = _client(endpoints, secret, "victim")
    batch = client.lease(table, task, ["x"], count=ack_n, timeout=10)
    acked = client.ack(batch).acked
    held = client.lease(table, task, ["x"], count=hold_n, lease_s=1.0, timeout=10)
    Path(out).write_text(json.dumps({"acked": acked, "held": held.row_ids}))
    time.sleep(600)


def drain(endpoints: str, secret: bytes, table: str, task: str, total: int, out: str) -> None:
    """Consume until every row of the task is done; record what this process acked."""
    client = _client(endpoints, secret, "survivor")
    received, acked = [], []
    deadline = time.monotonic() + 60
    while client.table_stats(table)["tasks"][task]["done"] < total and time.monotonic() < deadline:
        batch = client.lease(table, task, ["x"], count=4, min_count=1, lease_s=5.0, timeout=0.5)
        if batch is not None:
            received += batch.row_ids
            acked += client.ack(batch).acked
    Path(out).write_text(json.dumps({"received": received, "acked": acked}))
    client.close()


def ring_member(
    endpoints: str,
    secret: bytes,
    ring: str,
    member: str,
    members: list[tuple[str, str]],
    cycles: int,
    out: str,
    stop: str,
) -> None:
    """ON_DEMAND members take the token `cycles` times; FALLBACK members serve until `stop` exists."""
    client = _client(endpoints, secret, member)
    events: list[list] = []
    handle: GpuTokenRing

    def on_acquire(grant):
        events.append(["acquire", grant.seq, grant.payload, time.monotonic()])

    def on_release():
        events.append(["release", handle.grant.seq, None, time.monotonic()])

    handle = GpuTokenRing(client, ring, member, members, on_acquire=on_acquire, on_release=on_release)
    if dict(members)[member] == ON_DEMAND:
        for i in range(cycles):
            handle.acquire(timeout=60)
            time.sleep(0.002)  # "compute" while holding the devices
            handle.release(payload={"by": member, "cycle": i})
    else:
        while not Path(stop).exists():
            handle.poll(wait_s=0.1)
    audit = handle.audit()
    retained = client.stream_stats(ledger_stream(ring))["retained"]
    handle.close()
    log = {"events": events, "audit": audit.summary(), "clean": audit.clean, "ledger_retained": retained}
    Path(out).write_text(json.dumps(log))
    client.close()


def host_dataplane(secret: bytes, out: str) -> None:
    """A process that hosts a data plane, reports its server pids, and waits to be killed."""
    from meshy.dataplane import DataPlaneServer

    server = DataPlaneServer.start(secret)
    Path(out).write_text(json.dumps(server.pids))
    time.sleep(600)


def churn_consumer(endpoints: str, secret: bytes, table: str, task: str, log: str) -> None:
    """Lease whole groups and ack them forever, logging every ack result line by line (killed at random)."""
    client = _client(endpoints, secret, "churn")
    with open(log, "a") as out:
        while True:
            batch = client.lease(table, task, ["x"], count=2, min_count=1, whole_groups=True, lease_s=1.0, timeout=1)
            if batch is None:
                continue
            time.sleep(0.05)  # the work: a kill here leaves the rows leased, unacked
            result = client.ack(batch)
            out.write(json.dumps({"acked": result.acked, "stale": result.stale, "already": result.already}) + "\n")
            out.flush()


def weight_sync_member(
    port: int,
    rank: int,
    size: int,
    announced,
    out: str,
    corrupt: bool = False,
    quitter: int | None = None,
    hosted: bool = False,
) -> None:
    """One member of a weight-sync group: rank 0 packs seeded tensors into small buckets and broadcasts
    them (announcing the version on `announced`, a queue standing in for the `weights` stream); the
    others receive and write what they got, or the error, to `out`. Rank `quitter` exits instead of
    receiving. hosted: rank 0 hosts the group, and the others form it where the announcement says, as
    SGLang's schedulers do (torch's named-group helper over a tcp:// rendezvous)."""
    import torch
    import torch.distributed as dist

    from meshy.dataplane.weight_sync import WeightSyncGroup
    from meshy.dataplane.weights import BucketLayout, Published, Transport, tensors_checksum

    if hosted:
        group = WeightSyncGroup.hosting("127.0.0.1", size, "meshy-test", timeout_s=60) if rank == 0 else None
    else:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timedelta(seconds=60))
        group = WeightSyncGroup(store, rank, size, timeout_s=60)
        store.set(f"connected/{rank}", "1")  # this member's connections to every other are up
    if rank == 0:
        tensors = sync_tensors()
        layout = BucketLayout.plan([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], bucket_bytes=1000)
        buckets = layout.allocate()  # several buckets
        layout.pack(buckets, tensors.items())
        checksum = tensors_checksum({**tensors, "w": tensors["w"] + 1} if corrupt else tensors)
        meta = {"config": {"model_type": "test"}, "buckets": layout.sizes, "tensors": layout.manifest}
        if hosted:
            meta["rendezvous"] = group.rendezvous
        published = Published(1, Transport.COLLECTIVE, json.dumps(meta), checksum, sum(layout.sizes.values()), 0.0)
        for _ in range(size - 1):
            announced.put(published.to_message())
        t0 = time.monotonic()
        try:
            group.send(published, buckets)
        except Exception as e:
            Path(out).write_text(json.dumps({"error": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - t0}))
            return
        Path(out).write_text(json.dumps({"buckets": len(buckets)}))
        return
    if rank == quitter:  # dies once every member is connected: mid-broadcast, not while connecting
        store.wait([f"connected/{r}" for r in range(size)], timedelta(seconds=60))
        Path(out).write_text("{}")
        return
    published = Published.from_message(announced.get(timeout=60))
    if hosted:
        group = WeightSyncGroup.over(named_group(json.loads(published.location)["rendezvous"], rank))
    try:
        config, received = group.receive(published)
    except Exception as e:
        Path(out).write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return
    expected = sync_tensors()
    same = sorted(received) == sorted(expected) and all(
        received[n].dtype == expected[n].dtype and torch.equal(received[n], expected[n]) for n in expected
    )
    Path(out).write_text(json.dumps({"config": config, "bit_exact": same}))


def named_group(place: dict, rank: int):
    """Rank `rank` of the gloo group `place` names, formed the way SGLang's init_weights_update_group forms
    its update group: a tcp:// rendezvous, its store prefixed with the group's name, torch's helper."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper

    timeout = timedelta(seconds=60)
    url = f"tcp://{place['address']}:{place['port']}"
    store, _, _ = next(dist.rendezvous(url, rank, place["size"], timeout=timeout))
    store = dist.PrefixStore(place["group"], store)
    group, _ = _new_process_group_helper(
        place["size"], rank, [], Backend("gloo"), store, group_name=place["group"], timeout=timeout
    )
    return group


def sync_tensors() -> dict:
    import torch

    g = torch.Generator(device="cpu").manual_seed(7)
    return {
        "w": torch.randn(17, 13, generator=g, device="cpu").to(torch.bfloat16),
        "b": torch.randn(300, generator=g, device="cpu"),
        "e": torch.randn(2, 3, 5, generator=g, device="cpu").to(torch.float16),
    }


def wait_to_lease(endpoints: str, secret: bytes, table: str, task: str, out: str) -> None:
    """Say who this consumer is, then wait to lease rows (none are ready) until killed."""
    client = _client(endpoints, secret, "waiting")
    Path(out).write_text(client.consumer_id)
    client.lease(table, task, ["x"], count=1, timeout=600)
