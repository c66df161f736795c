"""TOML text from the data tomllib reads (tables, arrays, strings, numbers, booleans, dates and times).

The standard library reads TOML and writes none; a run directory's recipe.toml is written with this when
`--set` changed the recipe file's data (meshy.recipes.recipe.overrides). Tables become [section] headers, tables
inside arrays inline tables; `tomllib.loads(dumps(data)) == data`.
"""

import datetime
import json
import math
import re
from typing import Any

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def dumps(data: dict[str, Any]) -> str:
    """`data` as a TOML document."""
    lines: list[str] = []
    _table(data, (), lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _table(table: dict[str, Any], path: tuple[str, ...], lines: list[str]) -> None:
    values = [(key, value) for key, value in table.items() if not isinstance(value, dict)]
    tables = [(key, value) for key, value in table.items() if isinstance(value, dict)]
    if path and (values or not tables):  # a table holding only tables is defined by theirs
        lines += ["", f"[{'.'.join(map(_key, path))}]"]
    lines += [f"{_key(key)} = {_value(value)}" for key, value in values]
    for key, value in tables:
        _table(value, (*path, key), lines)


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    raise TypeError(f"not a TOML value: {type(value).__name__} {value!r}")


def _float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)  # always with a "." or an exponent: 3e-4 is 0.0003, 1e16 is 1e+16


def _string(text: str) -> str:
    """A basic string: JSON's escapes are TOML's, but for DEL, which TOML wants escaped too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")
