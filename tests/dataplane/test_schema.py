import pytest
import torch

from meshy.dataplane import Column, DataPlaneConfig, SchemaError, TableSpec

SPEC = TableSpec(
    "rollout",
    (
        Column("prompt_ids", "int64", (None,)),
        Column("topk", "float32", (None, 4)),
        Column("reward", "float32"),
        Column("tokens", "int64", (8,)),
        Column("note", "str"),
    ),
    max_row_bytes=1024,
)


def test_valid_write_of_every_kind_passes():
    SPEC.check_write(
        [0, 1],
        {
            "prompt_ids": [torch.arange(3), torch.arange(5)],
            "topk": [torch.zeros(2, 4), torch.zeros(0, 4)],
            "reward": torch.tensor([1.0, 0.0]),
            "tokens": torch.zeros(2, 8, dtype=torch.int64),
            "note": ["a", "b"],
        },
    )


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"rewrd": torch.zeros(2)}, "no column 'rewrd'; expected one of ['prompt_ids', 'topk', 'reward'"),
        ({"reward": torch.zeros(2, dtype=torch.float64)}, "column 'reward': expected a float32 tensor of shape (2,)"),
        ({"tokens": torch.zeros(2, 9, dtype=torch.int64)}, "column 'tokens': expected a int64 tensor of shape (2, 8)"),
        ({"tokens": torch.zeros(3, 8, dtype=torch.int64)}, "got int64 (3, 8)"),
        ({"prompt_ids": torch.zeros(2, 3, dtype=torch.int64)}, "column 'prompt_ids': expected a list of tensors"),
        ({"prompt_ids": [torch.arange(3), torch.zeros(3)]}, "column 'prompt_ids': row 1 is float32 tensor (3,)"),
        ({"topk": [torch.zeros(2, 4), torch.zeros(2, 5)]}, "expected dtype float32, row shape ('L', 4)"),
        ({"note": ["a", 3]}, "column 'note': row 1 is int, expected str"),
        ({"reward": [1.0, 2.0]}, "column 'reward': row 0 is float, expected dtype float32, row shape ()"),
        ({"reward": (torch.zeros(2),)}, "column 'reward': expected a tensor of shape (2,) for 2 rows, got tuple of 1"),
        ({}, "expected a non-empty mapping"),
    ],
)
def test_bad_writes_name_the_column_and_what_was_expected(values, needle):
    with pytest.raises(SchemaError) as err:
        SPEC.check_write([0, 1], values)
    assert needle in str(err.value)


def test_row_over_the_size_limit_names_row_and_largest_column():
    with pytest.raises(
        SchemaError, match=r"row 7 is 1064 bytes, over max_row_bytes 1024 \(largest column 'prompt_ids'"
    ):
        SPEC.check_write([6, 7], {"prompt_ids": [torch.arange(2), torch.arange(133)]})


@pytest.mark.parametrize(
    ("row_ids", "needle"),
    [([1, 1], "1 appears more than once"), ([-1, 0], "non-negative ints"), ([], "non-empty"), ("ab", "non-empty")],
)
def test_bad_row_ids(row_ids, needle):
    with pytest.raises(SchemaError, match=needle):
        SPEC.check_write(row_ids, {"reward": torch.zeros(2)})


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: Column("x", "float8"), "column 'x': dtype 'float8' is not one of"),
        (lambda: Column("x", "int64", (4, None)), "None allowed only as the first"),
        (lambda: Column("x", "str", (2,)), "a str column has shape ()"),
        (lambda: Column("x", "int64", (None, 0)), r"a ragged column's other dimensions must be > 0"),
        (lambda: Column("x", "int64", [4]), r"Column.shape: expected tuple\[int \| None, ...\], got list"),
        (lambda: TableSpec("t", (Column("a", "bool"), Column("a", "bool"))), "repeated: \\['a'\\]"),
        (lambda: TableSpec("t", (Column("a", "bool"),), group_size=0), "group_size must be >= 1"),
        (lambda: TableSpec("t", ()), "at least one column"),
    ],
)
def test_bad_schemas(make, needle):
    with pytest.raises(SchemaError, match=needle):
        make()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_storage_units": "2"}, "DataPlaneConfig.num_storage_units: expected int, got str '2'"),
        ({"num_storage_units": 0}, "num_storage_units: expected an integer >= 1"),
        ({"rpc_timeout_s": 0}, "rpc_timeout_s: expected finite seconds > 0"),
        ({"rpc_timeout_s": float("inf")}, "rpc_timeout_s: expected finite seconds > 0, got inf"),
        ({"encrypt": "yes"}, "DataPlaneConfig.encrypt: expected bool | None"),
        ({"host": "localhost"}, "host: expected an IP address"),
        ({"lease_s": True}, "DataPlaneConfig.lease_s: expected float, got bool"),
    ],
)
def test_bad_config_names_the_field(kwargs, needle):
    with pytest.raises(SchemaError, match=needle.replace("(", r"\(").replace("|", r"\|")):
        DataPlaneConfig(**kwargs)


def test_encryption_defaults_on_off_loopback():
    assert not DataPlaneConfig().encrypted
    assert DataPlaneConfig(host="10.0.0.5").encrypted
    assert DataPlaneConfig(encrypt=True).encrypted


def test_spec_survives_the_wire():
    assert TableSpec.from_wire(SPEC.to_wire()) == SPEC


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int32", "int64", "bfloat16", "float16", "float32", "float64"])
def test_every_dtype_round_trips_through_storage_bytes(dtype):
    torch_dtype = getattr(torch, dtype)
    dense = Column("d", dtype, (2, 3))
    values = (torch.randn(4, 2, 3) * 100).to(torch_dtype)
    stored = dense.to_storage(values)
    assert [type(v) for v in stored] == [bytes] * 4
    assert torch.equal(dense.from_storage(stored), values)
    rows = [values[i].clone() for i in range(4)]  # a dense column given as a list of rows
    assert torch.equal(dense.from_storage(dense.to_storage(rows)), values)


def test_ragged_rows_keep_their_lengths_and_inner_shape():
    ragged = Column("topk", "float32", (None, 4))
    rows = [torch.randn(3, 4), torch.zeros(0, 4), torch.randn(1, 4)]
    back = ragged.from_storage(ragged.to_storage(rows))
    assert [tuple(r.shape) for r in back] == [(3, 4), (0, 4), (1, 4)]
    assert all(torch.equal(a, b) for a, b in zip(rows, back, strict=True))
    empty = Column("ids", "int64", (None,))
    assert [r.shape for r in empty.from_storage(empty.to_storage([torch.zeros(0, dtype=torch.int64)] * 2))] == [
        (0,),
        (0,),
    ]


def test_stored_rows_are_independent_of_the_written_tensor():
    column = Column("tokens", "int64", (None,))
    row = torch.arange(5)
    stored = column.to_storage([row, row[1:3]])
    row.zero_()  # the producer reuses its buffer after the put
    assert [r.tolist() for r in column.from_storage(stored)] == [[0, 1, 2, 3, 4], [1, 2]]
    assert Column("note", "str").from_storage(Column("note", "str").to_storage(["a", "é"])) == ["a", "é"]
