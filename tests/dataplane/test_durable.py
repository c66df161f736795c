"""Durable rows: the storage units' logs and the controller's journal, read back by a data plane started
again over the same directory (real server processes, SIGKILLed)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshy.dataplane import (
    Column,
    DataPlaneClient,
    DataPlaneConfig,
    DataPlaneServer,
    SchemaError,
    TableSpec,
    durable_storage,
    journal,
)
from meshy.dataplane.controller import CLEAR_DELAY_S
from meshy.dataplane.journal import Journal
from meshy.dataplane.record_log import RecordLog, read
from meshy.dataplane.tables import TableState

REPO = Path(__file__).resolve().parents[2]
SPEC = TableSpec(
    "rows",
    (Column("ids", "int64", (None,)), Column("text", "str"), Column("score", "float32")),
    group_size=2,
    retire_after=("train",),
)


def config(directory: Path, **fields) -> DataPlaneConfig:
    return DataPlaneConfig(num_storage_units=2, durable_dir=str(directory), **fields)


def kill(server: DataPlaneServer) -> None:
    """SIGKILL the launcher; its servers die with it (PR_SET_PDEATHSIG)."""
    os.kill(server.pids["launcher"], signal.SIGKILL)
    for pid in [server.pids["controller"], *server.pids["storage"]]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
    server.shutdown()


def put_groups(client: DataPlaneClient, groups: range) -> None:
    rows = [r for g in groups for r in (2 * g, 2 * g + 1)]
    ids = [torch.arange(r % 5 + 1) for r in rows]
    client.put("rows", rows, {"ids": ids, "text": [f"row {r}" for r in rows]}, group_ids=[r // 2 for r in rows])


def test_a_record_log_reads_back_what_was_appended_and_cuts_a_torn_tail(tmp_path):
    path = tmp_path / "a.log"
    log, contents = RecordLog.open(path, "batched", 0.01)
    assert contents.records == [] and contents.torn_bytes == 0
    for record in [("put", [1, 2], {"x": [b"ab", "cd"]}), ("clear", [1])]:
        log.append(record)
    log.close()
    whole = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x10\x00\x00\x00partial")  # a header promising 16 bytes, and fewer
    log, contents = RecordLog.open(path, "sync", 0.01)
    assert contents.records == [("put", [1, 2], {"x": [b"ab", "cd"]}), ("clear", [1])]
    assert contents.torn_bytes == 11 and path.stat().st_size == whole
    log.append(("clear", [2]))
    log.close()
    assert read(path).records[-1] == ("clear", [2]) and read(path).torn_bytes == 0
    data = bytearray(path.read_bytes())
    data[12] ^= 0xFF  # a flipped bit in the first record: nothing after it is trusted
    path.write_bytes(bytes(data))
    assert read(path).records == [] and read(path).torn_bytes == len(data)


FULL_DISK = """
import resource, signal, sys
sys.path.insert(0, {repo!r})
from meshy.dataplane.record_log import RecordLog, read
log, _ = RecordLog.open({path!r}, "sync", 0.1)
log.append(("small", b"x" * 100))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    log.append(("big", b"y" * 10000))
except OSError as e:
    print("refused:", e)
log.append(("after", b"z" * 100))
print(read({path!r}).records)
"""


def test_a_write_that_fails_leaves_the_log_as_it_was_and_later_records_readable(tmp_path):
    path = str(tmp_path / "full.log")
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK.format(repo=str(REPO), path=path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: [Errno 27] File too large" in result.stdout
    assert "[('small', b'" in result.stdout and "('after', b'zzz" in result.stdout and "'big'" not in result.stdout


def test_the_journal_replays_tables_to_the_same_state_before_and_after_compaction(tmp_path, monkeypatch):
    live = TableState(SPEC)
    log, restored = Journal.open(tmp_path, "batched", 0.01)
    assert restored.tables == {} and restored.high_water == 0

    def apply(record: str, *args) -> None:
        getattr(log, record)(*args)

    apply("table", SPEC)
    live.declare_task("train", ["ids", "text"], True)
    apply("task", "rows", "train", ["ids", "text"], True)
    for g in range(4):
        rows = [2 * g, 2 * g + 1]
        live.commit(True, rows, [g, g], ["ids", "text"], [10 * g, 10 * g + 1])
        apply("commit", "rows", True, rows, [g, g], ["ids", "text"], [10 * g, 10 * g + 1])
    live.commit(False, [6, 7], None, ["score"], [90, 91])
    apply("commit", "rows", False, [6, 7], None, ["score"], [90, 91])
    live.ack("train", [0, 1], "c")
    apply("ack", "rows", "train", [0, 1])
    live.drop([2, 3])
    apply("drop", "rows", [2, 3])
    apply("high_water", 92)
    log.close()

    def replayed() -> tuple[dict, int]:
        journal_log, restored = Journal.open(tmp_path, "batched", 0.01)
        journal_log.close()
        return restored.tables["rows"].snapshot(), restored.high_water

    expected = live.snapshot()
    assert expected["retired"] == 4 and [r[0] for r in expected["rows"]] == [4, 5, 6, 7]
    assert replayed() == (expected, 92)
    monkeypatch.setattr(journal, "COMPACT_SLACK_BYTES", 0)
    log, restored = Journal.open(tmp_path, "batched", 0.01)
    before = log.size
    log.compact_if_due(restored.tables, restored.high_water)
    assert log.size < before and len(read(tmp_path / journal.JOURNAL_FILE).records) == 1
    log.close()
    assert replayed() == (expected, 92)
    table = TableState.from_snapshot(expected)  # rows not yet done are offered again, in order
    assert table.lease("train", "c", 10, 1, 60.0, 0.0, 1).row_ids == [4, 5, 6, 7]


def test_a_killed_data_plane_started_again_has_every_row_not_retired_and_offers_leased_ones_again(secret, tmp_path):
    """Also: a torn record at the end of a storage log (a unit killed in the middle of a write) is cut and
    reported, and the rows before it are kept."""
    cfg = config(tmp_path)
    server = DataPlaneServer.start(secret, cfg)
    try:
        assert server.restored["controller"] == {"rows": {}, "torn_bytes": 0, "log_bytes": 0}
        with DataPlaneClient(server.endpoints, secret, cfg) as client:
            client.create_table(SPEC)
            put_groups(client, range(4))
            trained = client.lease("rows", "train", ["ids", "text"], 1, whole_groups=True)
            client.ack(trained)  # group 0 retires
            client.add_columns("rows", [2, 3], {"score": torch.tensor([0.5, 1.5])})
            held = client.lease("rows", "train", ["ids", "text"], 1, whole_groups=True)  # group 1: its holder dies
            assert held.group_ids == [1, 1]
            before = client.peek("rows", ["ids", "text", "score"])
            time.sleep(4 * CLEAR_DELAY_S)  # the retired group's storage is cleared in batches
    finally:
        kill(server)
    with open(tmp_path / "storage-0.log", "ab") as f:
        f.write(b"\xff\x00\x00\x00torn")  # a header promising 255 bytes, and 4
    server = DataPlaneServer.start(secret, cfg)
    try:
        assert server.restored["controller"]["rows"] == {"rows": 6}
        assert [unit["torn_bytes"] for unit in server.restored["storage"]] == [8, 0]
        assert sum(unit["rows"] for unit in server.restored["storage"]) == 6 + 2  # a key per row, one per score
        with DataPlaneClient(server.endpoints, secret, cfg) as client:
            client.create_table(SPEC)
            after = client.peek("rows", ["ids", "text", "score"])
            assert after.row_ids == before.row_ids == [2, 3, 4, 5, 6, 7]
            for name in ("ids", "text", "score"):
                assert [_plain(v) for v in after.columns[name]] == [_plain(v) for v in before.columns[name]]
            assert client.table_stats("rows")["retired"] == 1 * 2
            again = client.lease("rows", "train", ["ids", "text"], 3, min_count=1, whole_groups=True, timeout=5)
            assert again.group_ids == [1, 1, 2, 2, 3, 3], "the dead holder's group is offered again, first"
            put_groups(client, range(4, 8))  # new keys never land on a restored row's
            assert client.written("rows", list(range(16))) == [2, 3, 4, 5, 6, 7, *range(8, 16)]
            assert [_plain(v) for v in client.peek("rows", ["ids"]).columns["ids"][:6]] == [
                _plain(v) for v in before.columns["ids"]
            ]
            with pytest.raises(SchemaError, match="row 2 is leased for task 'train'; not dropped"):
                client.drop("rows", [2, 3])
            client.ack(again)
            assert client.drop("rows", [8, 9]) == 2
            assert client.written("rows", [8, 9, 10]) == [10]
    finally:
        kill(server)


def _plain(value):
    return value.tolist() if isinstance(value, torch.Tensor) else value


def test_retiring_rows_bounds_the_logs_on_disk(secret, tmp_path):
    """40 MB through the data plane, retired as it goes: the storage logs are compacted instead of holding it
    all, and once the clears have landed, a log holds no more than twice its live rows plus the slack."""
    cfg = config(tmp_path)
    payload = "x" * (64 << 10)
    logs = [tmp_path / f"storage-{u}.log" for u in range(2)]

    def put_and_train(g: int) -> None:
        client.put("rows", [2 * g, 2 * g + 1], {"text": [payload, payload]}, group_ids=[g, g])
        client.ack(client.lease("rows", "train", ["text"], 1, whole_groups=True))

    with DataPlaneServer.start(secret, cfg) as server, DataPlaneClient(server.endpoints, secret, cfg) as client:
        client.create_table(SPEC)
        largest = 0
        for g in range(320):
            put_and_train(g)
            largest = max(largest, *(log.stat().st_size for log in logs))
        time.sleep(4 * CLEAR_DELAY_S)
        put_and_train(320)  # the first write after the clears compacts
        put_and_train(321)
        assert client.table_stats("rows")["retired"] == 644
        final = [log.stat().st_size for log in logs]
    written = 322 * 2 * len(payload)
    assert largest < written / 3, largest  # each unit took half of it
    assert max(final) <= durable_storage.COMPACT_SLACK_BYTES + 4 * 2 * len(payload), final
    assert (tmp_path / journal.JOURNAL_FILE).stat().st_size < journal.COMPACT_SLACK_BYTES


FULL_DISK_SERVER = """
import resource, signal, sys
sys.path.insert(0, {repo!r})
from meshy.dataplane import Column, DataPlaneClient, DataPlaneConfig, DataPlaneError, DataPlaneServer, TableSpec
from meshy.dataplane import new_secret
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # inherited by the servers: a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
secret, cfg = new_secret(), DataPlaneConfig(durable_dir={path!r})
spec = TableSpec("t", (Column("text", "str"),))
with DataPlaneServer.start(secret, cfg) as server, DataPlaneClient(server.endpoints, secret, cfg) as client:
    client.create_table(spec)
    client.put("t", [0], {{"text": ["small"]}})
    try:
        client.put("t", [1], {{"text": ["y" * (2 << 20)]}})
    except DataPlaneError as e:
        print("refused:", e)
    client.put("t", [2], {{"text": ["after"]}})
    print("rows:", client.written("t", [0, 1, 2]))
"""


def test_a_storage_unit_that_cannot_write_its_log_refuses_the_put_instead_of_keeping_it_in_memory_only(tmp_path):
    code = FULL_DISK_SERVER.format(repo=str(REPO), path=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: storage unit" in result.stdout and "File too large" in result.stdout, result.stdout
    assert "rows: [0, 2]" in result.stdout


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("durable", "always", "DataPlaneConfig.durable: expected Literal['off', 'batched', 'sync']"),
        ("durable_sync_s", 0.0, "DataPlaneConfig.durable_sync_s: expected finite seconds > 0"),
    ],
)
def test_wrong_durable_settings_are_refused_naming_the_field(field, value, expected):
    with pytest.raises(SchemaError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        DataPlaneConfig(**{field: value})


def test_a_data_plane_without_a_directory_or_with_durable_off_writes_nothing(secret, tmp_path):
    assert not DataPlaneConfig().keeps_rows
    cfg = config(tmp_path, durable="off")
    with DataPlaneServer.start(secret, cfg) as server, DataPlaneClient(server.endpoints, secret, cfg) as client:
        client.create_table(SPEC)
        put_groups(client, range(2))
        assert server.restored["controller"] is None
    assert list(tmp_path.iterdir()) == []


def test_a_durable_storage_unit_refuses_values_that_do_not_match_their_keys(tmp_path):
    data = durable_storage.DurableUnitData(tmp_path / "u.log", "batched", 0.01)
    with pytest.raises(ValueError, match="field 'x': 1 values for 2 keys"):
        data.put_data({"x": [b"a"]}, [1, 2])
    data.close()
    assert read(tmp_path / "u.log").records == []


def test_a_lease_less_peek_and_drop_check_their_input(client, unique):
    name = unique("peek")
    client.create_table(TableSpec(name, (Column("text", "str"),)))
    with pytest.raises(SchemaError, match="no column 'nope'"):
        client.peek(name, ["nope"])
    with pytest.raises(SchemaError, match="drop row_ids: expected non-negative ints"):
        client.drop(name, [-1])
    assert client.peek(name, ["text"]).row_ids == [] and client.drop(name, [5]) == 0
