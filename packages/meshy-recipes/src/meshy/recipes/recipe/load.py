"""Reading a recipe: a TOML file, `--set` overrides applied to its data, the sections built (each checking
its own fields) and then the whole run checked (meshy.recipes.recipe.checks)."""

import tomllib
from collections.abc import Sequence
from pathlib import Path

from meshy.dataplane import SchemaError
from meshy.recipes.recipe.checks import check_recipe
from meshy.recipes.recipe.overrides import Override, apply_overrides, blamed
from meshy.recipes.recipe.spec import DEFAULT_RECIPE, Recipe, build


def load_recipe(source: str | Path | None = None, overrides: Sequence[Override] = ()) -> Recipe:
    """A recipe from a TOML file (None: the embedded default), with `--set` overrides applied to its data."""
    path = Path(source) if source is not None else DEFAULT_RECIPE
    if not path.is_file():
        raise SchemaError(f"recipe: no file {path}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SchemaError(f"recipe {path}: not valid TOML: {e}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise SchemaError(f"recipe {path}: arrays or tables nested too deeply") from None
    data = apply_overrides(data, overrides)
    try:
        recipe = build(Recipe, data, "recipe")
        check_recipe(recipe)
    except SchemaError as e:
        raise blamed(e, overrides) from None
    return recipe
