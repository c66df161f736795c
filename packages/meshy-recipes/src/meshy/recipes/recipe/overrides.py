"""`--set FIELD=VALUE`: a recipe field changed on the command line (`meshy run`, `meshy check`).

An override is applied to the recipe file's TOML data before the recipe is built, so it is typed and
checked exactly as the same value written in the file (meshy.recipes.recipe.load_recipe). VALUE is read
as a TOML value (1e-4, 200, true, "none", [1, 2], {a = 1}); a bare word that is not one is a string.
A run's directory keeps the recipe as run: the file, or with overrides the data they produce.
"""

import copy
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshy.dataplane import SchemaError
from meshy.recipes.recipe.toml_writer import dumps


@dataclass(frozen=True)
class Override:
    path: tuple[str, ...]  # ("algorithm", "optim", "lr")
    value: Any
    text: str  # as given: "algorithm.optim.lr=1e-4"

    def named_in(self, message: str) -> bool:
        """Whether a recipe error is about this field: it names the field's dotted path, or it starts with a
        section on the path (recipe.algorithm.optim:) and names the field under it before any detail
        (`OptimConfig.lr: expected ...`, `unknown field 'lrr'; expected one of ...`)."""
        if re.search(rf"(?<![\w.])(?:recipe\.)?{re.escape('.'.join(self.path))}\b", message):
            return True
        for depth in range(min(1, len(self.path) - 1), len(self.path)):
            section = ".".join(("recipe", *self.path[:depth])) + ": "
            head = message.removeprefix(section).split(": ")[0].split("; ")[0]
            if message.startswith(section) and re.search(rf"\b{re.escape(self.path[depth])}\b", head):
                return True
        return False


def parse_override(text: str) -> Override:
    """FIELD=VALUE, FIELD a dotted path from the recipe's top (steps, algorithm.optim.lr)."""
    key, equals, raw = text.partition("=")
    path = tuple(part.strip() for part in key.split("."))
    if not equals or not all(path):
        raise SchemaError(f"--set {text}: expected FIELD=VALUE, FIELD a dotted path such as algorithm.optim.lr")
    return Override(path, _toml_value(text, raw.strip()), text)


def _toml_value(text: str, raw: str) -> Any:
    try:
        parsed = tomllib.loads(f"value = {raw}")
        if parsed.keys() == {"value"}:
            return parsed["value"]
    except (tomllib.TOMLDecodeError, RecursionError):
        pass
    if raw.startswith(("[", "{", '"', "'")) or "\n" in raw:
        raise SchemaError(
            f"--set {text}: {raw!r} is not a TOML value (expected a number, boolean, string, array or inline table)"
        )
    return raw  # a bare word: a string


def apply_overrides(data: dict[str, Any], overrides: Sequence[Override]) -> dict[str, Any]:
    """A copy of a recipe's TOML data with each override set, tables made on the way as needed."""
    data = copy.deepcopy(data)
    for override in overrides:
        table = data
        for depth, key in enumerate(override.path[:-1]):
            table = table.setdefault(key, {})
            if not isinstance(table, dict):
                where = ".".join(("recipe", *override.path[: depth + 1]))
                raise SchemaError(f"--set {override.text}: {where} is {type(table).__name__} {table!r}, not a table")
        table[override.path[-1]] = override.value
    return data


def blamed(error: SchemaError, overrides: Sequence[Override]) -> SchemaError:
    """A recipe error, led by the overrides it is about (if any)."""
    culprits = [f"--set {o.text}" for o in overrides if o.named_in(str(error))]
    return SchemaError(f"{'; '.join(culprits)}: {error}") if culprits else error


def recipe_as_run(source: Path, overrides: Sequence[Override]) -> bytes:
    """What a run directory keeps as its recipe.toml, which its ranks and `meshy run --resume` read: the
    file as given, or with overrides the data they produce (the file's comments are lost) under a comment
    saying how it was made."""
    if not overrides:
        return source.read_bytes()
    data = apply_overrides(tomllib.loads(source.read_text(encoding="utf-8")), overrides)
    made = f"# {source} with " + " ".join(f"--set {o.text}" for o in overrides)
    return ("".join(c if c.isprintable() else "?" for c in made) + "\n" + dumps(data)).encode()
