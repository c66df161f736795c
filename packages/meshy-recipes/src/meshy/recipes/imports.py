"""Recipes name code by import path ("package.module:name"); one loader resolves them all."""

import importlib
from typing import Any

from meshy.dataplane import SchemaError


def import_object(path: str, field: str) -> Any:
    """The object `path` names; a SchemaError naming the recipe `field` if it cannot be imported."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        raise SchemaError(f"{field}: {path!r}: no module {e.name!r}") from None
    except AttributeError:
        raise SchemaError(f"{field}: {path!r}: module {module!r} has no {name!r}") from None
