"""Checks a dataclass's values against its type annotations, naming the first field that is wrong."""

import types
import typing
from dataclasses import fields
from typing import Any

from meshy.dataplane.errors import SchemaError


def check_fields(obj: Any) -> None:
    """Raise SchemaError naming `Class.field`, the expected type and the value, for the first mismatch."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if not _matches(value, f.type):
            raise SchemaError(
                f"{type(obj).__name__}.{f.name}: expected {_describe(f.type)}, got {type(value).__name__} {value!r}"
            )


def _matches(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is Any:
        return True
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is tuple:
        args = typing.get_args(annotation)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(args) == len(value) and all(_matches(v, a) for v, a in zip(value, args, strict=True))
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, annotation)


def _describe(annotation: Any) -> str:
    """An annotation as written in the source: `tuple[CustomRoleSpec, ...]`, not its module's full path."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if annotation is Ellipsis:
        return "..."
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_describe(arg) for arg in args)
    if origin is typing.Literal:
        return f"Literal[{', '.join(map(repr, args))}]"
    if origin is not None:
        return f"{_describe(origin)}[{', '.join(map(_describe, args))}]"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")
