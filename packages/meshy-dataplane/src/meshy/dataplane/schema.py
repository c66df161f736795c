"""Tables and columns: what a table holds, and the checks every write passes before anything is sent."""

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from meshy.dataplane.devices import HOST
from meshy.dataplane.errors import SchemaError
from meshy.dataplane.fields import check_fields

TENSOR_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
STR_DTYPE = "str"
DEFAULT_MAX_ROW_BYTES = 64 << 20


@dataclass(frozen=True)
class Column:
    """One column of a table."""

    name: str
    """The column's name (not empty)."""
    dtype: str
    """One of bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64, or "str": one Python
    string per row (shape must be ())."""
    shape: tuple[int | None, ...] = ()
    """The shape of one row's value: () for a scalar, (4096,) for a fixed vector. A leading None makes the column
    ragged: (None,) is a variable-length sequence, (None, 8) a variable number of 8-vectors."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.name:
            raise SchemaError("Column.name: expected a non-empty string")
        if self.dtype not in TENSOR_DTYPES and self.dtype != STR_DTYPE:
            raise SchemaError(f"column '{self.name}': dtype {self.dtype!r} is not one of {[*TENSOR_DTYPES, STR_DTYPE]}")
        if self.dtype == STR_DTYPE and self.shape != ():
            raise SchemaError(f"column '{self.name}': a str column has shape (), got {self.shape}")
        for i, dim in enumerate(self.shape):
            if (dim is None and i > 0) or (dim is not None and dim < 0):
                raise SchemaError(
                    f"column '{self.name}': shape {self.shape} must be non-negative ints, "
                    "with None allowed only as the first (ragged) dimension"
                )
        if self.ragged and 0 in self.shape[1:]:  # a row's length is read back from its size in bytes
            raise SchemaError(f"column '{self.name}': a ragged column's other dimensions must be > 0, got {self.shape}")

    @property
    def ragged(self) -> bool:
        return bool(self.shape) and self.shape[0] is None

    def _expected(self) -> str:
        return f"dtype {self.dtype}, row shape {tuple('L' if d is None else d for d in self.shape)}"

    def check(self, value: Any, n_rows: int) -> list[int]:
        """Check one column's values for n_rows rows; return each row's size in bytes."""
        if self.dtype == STR_DTYPE:
            if not isinstance(value, list | tuple) or len(value) != n_rows:
                raise SchemaError(f"column '{self.name}': expected a list of {n_rows} str, got {_describe(value)}")
            for i, v in enumerate(value):
                if not isinstance(v, str):
                    raise SchemaError(f"column '{self.name}': row {i} is {type(v).__name__}, expected str")
            return [len(v.encode()) for v in value]
        dtype = TENSOR_DTYPES[self.dtype]
        if isinstance(value, torch.Tensor) and not self.ragged:
            expected = (n_rows, *self.shape)
            if value.dtype != dtype or tuple(value.shape) != expected:
                raise SchemaError(
                    f"column '{self.name}': expected a {self.dtype} tensor of shape {expected}, "
                    f"got {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
                )
            return [value[0].numel() * value.element_size()] * n_rows
        if not isinstance(value, list | tuple) or len(value) != n_rows:
            kind = "a list of tensors" if self.ragged else f"a tensor of shape {(n_rows, *self.shape)}"
            raise SchemaError(f"column '{self.name}': expected {kind} for {n_rows} rows, got {_describe(value)}")
        sizes = []
        for i, v in enumerate(value):
            if not isinstance(v, torch.Tensor) or v.dtype != dtype or not self._row_shape_ok(tuple(v.shape)):
                raise SchemaError(f"column '{self.name}': row {i} is {_describe(v)}, expected {self._expected()}")
            sizes.append(v.numel() * v.element_size())
        return sizes

    def _row_shape_ok(self, shape: tuple[int, ...]) -> bool:
        if len(shape) != len(self.shape):
            return False
        return all(want is None or want == got for want, got in zip(self.shape, shape, strict=True))

    def to_storage(self, value: Any) -> list:
        """One stored value per row, for a value `check` accepted: a str, or the row's raw bytes.

        msgpack carries bytes inline, where TransferQueue's wire gives every tensor a pickled header and
        a frame of its own: at RL row sizes (a few hundred bytes) that was ~50x the cost of the bytes.
        The column's dtype and shape say how to read them back (from_storage).
        """
        if self.dtype == STR_DTYPE:
            return list(value)
        if isinstance(value, torch.Tensor):  # dense, all rows in one tensor
            flat = value.detach().to(HOST).reshape(-1)
            sizes = [flat.numel() // len(value) * flat.element_size()] * len(value)
        else:
            flat = torch.cat([row.detach().to(HOST).reshape(-1) for row in value])
            sizes = [row.numel() * row.element_size() for row in value]
        data = flat.contiguous().view(torch.uint8).numpy().tobytes()  # a strided 1-D view stays strided
        out, start = [], 0
        for size in sizes:
            out.append(data[start : start + size])
            start += size
        return out

    def from_storage(self, values: list) -> torch.Tensor | list:
        """What a consumer gets from the stored rows: dense columns stacked, ragged ones a list of rows."""
        if self.dtype == STR_DTYPE:
            return list(values)
        dtype = TENSOR_DTYPES[self.dtype]
        data = bytearray().join(values)
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype, device=HOST)
        if not self.ragged:
            return flat.view(len(values), *self.shape)
        rows = flat.split([len(v) // flat.element_size() for v in values])
        return [row.view(-1, *self.shape[1:]) for row in rows]


@dataclass(frozen=True)
class TableSpec:
    """A table: its columns, how rows form groups, and when rows are deleted.

    group_size: rows per group (n samples of one prompt); a whole-group consumer never sees part of one.
    max_row_bytes: largest row a put accepts.
    retire_after: tasks whose acks end a row's life: once all of them acked it and no lease of any other
        task still holds it, the row is deleted (a task not listed sees only the rows still there).
    """

    name: str
    columns: tuple[Column, ...]
    group_size: int = 1
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
    retire_after: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.name:
            raise SchemaError("TableSpec.name: expected a non-empty string")
        if not self.columns:
            raise SchemaError(f"table '{self.name}': expected at least one column")
        names = [c.name for c in self.columns]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise SchemaError(f"table '{self.name}': column names must be unique, repeated: {duplicates}")
        if self.group_size < 1:
            raise SchemaError(f"table '{self.name}': group_size must be >= 1, got {self.group_size}")
        if self.max_row_bytes < 1:
            raise SchemaError(f"table '{self.name}': max_row_bytes must be >= 1, got {self.max_row_bytes}")

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise SchemaError(
            f"table '{self.name}' has no column '{name}'; expected one of {[c.name for c in self.columns]}"
        )

    def check_write(self, row_ids: Sequence[int], values: Mapping[str, Any]) -> None:
        """Check a put or add_columns against the schema before anything leaves the process."""
        check_row_ids(row_ids, "row_ids")
        if not isinstance(values, Mapping) or not values:
            raise SchemaError(f"table '{self.name}': expected a non-empty mapping of column name -> values")
        row_bytes = [0] * len(row_ids)
        largest: dict[int, tuple[int, str]] = {}
        for name, value in values.items():
            sizes = self.column(name).check(value, len(row_ids))
            for i, size in enumerate(sizes):
                row_bytes[i] += size
                if size > largest.get(i, (-1, ""))[0]:
                    largest[i] = (size, name)
        for i, total in enumerate(row_bytes):
            if total > self.max_row_bytes:
                size, name = largest[i]
                raise SchemaError(
                    f"table '{self.name}': row {row_ids[i]} is {total} bytes, over max_row_bytes "
                    f"{self.max_row_bytes} (largest column '{name}': {size} bytes)"
                )

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> "TableSpec":
        columns = tuple(Column(name=c["name"], dtype=c["dtype"], shape=tuple(c["shape"])) for c in data["columns"])
        return cls(
            name=data["name"],
            columns=columns,
            group_size=data["group_size"],
            max_row_bytes=data["max_row_bytes"],
            retire_after=tuple(data["retire_after"]),
        )


def check_row_ids(row_ids: Sequence[int], what: str) -> None:
    """Row and group ids are distinct non-negative ints (msgpack-native, cheap to index)."""
    if not isinstance(row_ids, Sequence) or isinstance(row_ids, str) or not row_ids:
        raise SchemaError(f"{what}: expected a non-empty sequence of ints, got {_describe(row_ids)}")
    seen = set()
    for r in row_ids:
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise SchemaError(f"{what}: expected non-negative ints, got {r!r}")
        if r in seen:
            raise SchemaError(f"{what}: {r} appears more than once")
        seen.add(r)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} tensor {tuple(value.shape)}"
    if isinstance(value, list | tuple):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__
