"""A data plane over two nodes (two hosts' server processes, here both on loopback): each node's storage
units, one controller over all of them; a producer's rows stay on its own node's units."""

import pytest
import torch

from meshy.dataplane import Column, DataPlaneClient, DataPlaneConfig, DataPlaneServer, Endpoints, SchemaError, TableSpec

ROW_BYTES = 64 * 1024  # each row carries 64 KiB, so the bytes that move are the rows, not the headers


@pytest.fixture(scope="module")
def two_nodes(secret):
    """Node 0 runs the controller and one storage unit, node 1 one storage unit."""
    config = DataPlaneConfig(num_storage_units=1)
    with DataPlaneServer.start_storage(secret, config) as node0, DataPlaneServer.start_storage(secret, config) as node1:
        node0.start_controller(node0.storage + node1.storage, [0, 1])
        yield node0.endpoints


def test_endpoints_say_which_node_each_storage_unit_is_on(two_nodes):
    assert two_nodes.storage_nodes == (0, 1) and two_nodes.units_on(1) == (1,)
    assert Endpoints.from_json(two_nodes.to_json()) == two_nodes


def test_each_producer_writes_to_its_own_node_and_a_consumer_reads_from_where_the_rows_are(two_nodes, secret, unique):
    table = TableSpec(unique("rows"), (Column("x", "float32", (ROW_BYTES // 4,)), Column("y", "float32")))
    node0 = DataPlaneClient(two_nodes, secret, name="node0", node=0)
    node1 = DataPlaneClient(two_nodes, secret, name="node1", node=1)
    try:
        node0.create_table(table)
        node1.put(table.name, list(range(32)), {"x": torch.ones(32, ROW_BYTES // 4, device="cpu")})
        node0.put(table.name, list(range(32, 48)), {"x": torch.zeros(16, ROW_BYTES // 4, device="cpu")})
        sent0, sent1 = node0.storage_bytes()["sent"], node1.storage_bytes()["sent"]
        assert sent1[0] == 0 and sent1[1] > 32 * ROW_BYTES, "node 1's rows went to node 1's unit only"
        assert sent0[1] == 0 and sent0[0] > 16 * ROW_BYTES, "node 0's rows went to node 0's unit only"

        batch = node0.lease(table.name, "consume", ["x"], count=48, timeout=10)
        assert sorted(batch.row_ids) == list(range(48))
        ones = {row: bool(x.eq(1).all()) for row, x in zip(batch.row_ids, batch.columns["x"], strict=True)}
        assert ones == {row: row < 32 for row in range(48)}
        moved = node0.storage_bytes()
        assert 32 * ROW_BYTES < moved["received"][1] < 33 * ROW_BYTES, "node 1's rows came from node 1"
        assert 16 * ROW_BYTES < moved["received"][0] < 17 * ROW_BYTES
        assert moved["sent"][1] < 1024, "to node 1, only the read request"

        node0.add_columns(table.name, batch.row_ids, {"y": torch.arange(48, dtype=torch.float32, device="cpu")})
        assert node0.storage_bytes()["sent"][1] == moved["sent"][1], "a column added on node 0 is stored on node 0"
        scored = node1.lease(table.name, "read_y", ["y"], count=48, timeout=10)
        assert scored.columns["y"].tolist() == [float(row) for row in scored.row_ids]
    finally:
        node0.close()
        node1.close()


def test_a_client_on_a_node_without_storage_is_refused(two_nodes, secret):
    with pytest.raises(SchemaError, match="node 2 has no storage unit; theirs: \\(0, 1\\)"):
        DataPlaneClient(two_nodes, secret, node=2)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"host": "10.0.0.5", "encrypt": False}, "DataPlaneConfig.encrypt: off loopback (host 10.0.0.5) connections"),
        ({"host": "0.0.0.0"}, "DataPlaneConfig.host: 0.0.0.0 is every interface; expected one address"),
    ],
)
def test_servers_never_bind_every_interface_nor_talk_in_the_clear_off_loopback(fields, needle):
    with pytest.raises(SchemaError) as raised:
        DataPlaneConfig(**fields)
    assert needle in str(raised.value)
