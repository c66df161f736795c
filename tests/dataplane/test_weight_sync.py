"""The collective weights transport with real processes: one publisher, two engines, a TCP store."""

import json
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from meshy.dataplane import SchemaError
from meshy.dataplane.errors import WeightSyncError
from meshy.dataplane.weight_sync import WeightSyncGroup
from meshy.dataplane.weights import Published, Transport
from tests.dataplane import workers


def run_group(
    mp_context, tmp_path, corrupt: bool = False, quitter: int | None = None, members: int = 3, hosted: bool = False
) -> list[dict]:
    store = dist.TCPStore(
        "127.0.0.1", 0, members, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    announced = mp_context.Queue()
    outs = [tmp_path / f"member{r}.json" for r in range(members)]
    procs = [
        mp_context.Process(
            target=workers.weight_sync_member,
            args=(store.port, r, members, announced, str(outs[r]), corrupt, quitter, hosted),
        )
        for r in range(members)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"member exited with {p.exitcode}"
    return [json.loads(out.read_text()) for out in outs]


def test_every_engine_receives_the_version_bit_for_bit_in_several_buckets(mp_context, tmp_path):
    sender, *engines = run_group(mp_context, tmp_path)
    assert sender["buckets"] > 1
    assert engines == [{"config": {"model_type": "test"}, "bit_exact": True}] * 2


def test_members_that_form_the_group_themselves_where_the_publisher_hosts_it_receive_it_bit_for_bit(
    mp_context, tmp_path
):
    """As SGLang's schedulers do: the announcement says where the group meets (a port the publisher chose)."""
    sender, *engines = run_group(mp_context, tmp_path, hosted=True)
    assert sender["buckets"] > 1
    assert engines == [{"config": {"model_type": "test"}, "bit_exact": True}] * 2


@pytest.mark.parametrize("hosted", [False, True])
def test_a_version_whose_bytes_do_not_match_its_checksum_is_refused(mp_context, tmp_path, hosted):
    _, *engines = run_group(mp_context, tmp_path, corrupt=True, hosted=hosted)
    for engine in engines:
        assert engine["error"] == "CorruptWeights: weights v1 (collective): checksum mismatch"


def test_an_engine_that_dies_fails_the_publisher_s_broadcast_at_once_not_at_the_timeout(mp_context, tmp_path):
    sender, *_ = run_group(mp_context, tmp_path, quitter=2)
    assert sender["error"].startswith("WeightSyncError: weight-sync group rank 0 of 3: broadcast of v1 bucket")
    assert sender["after_s"] < 30  # the group's timeout is 60 s


def test_a_member_that_never_joins_fails_the_group_at_its_timeout_naming_it():
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=2))
    t0 = time.monotonic()
    with pytest.raises(
        WeightSyncError, match="rank 0 of 2: could not connect to every member \\(not every member joined within 2 s"
    ):
        WeightSyncGroup(store, 0, 2, timeout_s=2)
    assert time.monotonic() - t0 < 30


def test_a_hosted_group_that_a_member_never_joins_fails_the_first_send_at_its_timeout():
    group = WeightSyncGroup.hosting("127.0.0.1", 2, "meshy-test", timeout_s=2)
    published = Published(1, Transport.COLLECTIVE, "{}", "", 0, 0.0)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="rank 0 of 2: could not connect to every member"):
        group.send(published, {})
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize(("rank", "size", "timeout_s"), [(0, 1, 60.0), (2, 2, 60.0), (0, 2, 0.0)])
def test_a_group_that_cannot_exist_is_refused_naming_what(rank, size, timeout_s):
    store = dist.HashStore()
    with pytest.raises(SchemaError, match="weight-sync group"):
        WeightSyncGroup(store, rank, size, timeout_s=timeout_s)
