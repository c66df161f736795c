"""The shipped recipes, by name, and what `meshy recipes` / `meshy check` print about a recipe."""

from pathlib import Path

from meshy.dataplane import SchemaError
from meshy.recipes.imports import import_object
from meshy.recipes.recipe import DEFAULT_RECIPE, Recipe, load_recipe
from meshy.recipes.topology import assign

SHIPPED_DIR = Path(__file__).with_name("recipes")
DEFAULT_NAME = "default"
ENOUGH_GPUS = 1 << 16  # `assign` with this many GPUs per node places every role; the highest index used counts


def shipped() -> dict[str, Path]:
    """Recipe name (file stem) -> file, the embedded default first."""
    return {DEFAULT_NAME: DEFAULT_RECIPE} | {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.toml"))}


def resolve(source: str | None) -> Path:
    """A recipe file from a path or a shipped recipe's name (None: the embedded default)."""
    if source is None:
        return DEFAULT_RECIPE
    path = Path(source)
    if path.is_file():
        return path
    recipes = shipped()
    if source in recipes:
        return recipes[source]
    raise SchemaError(f"recipe: {source!r} is neither a file nor a shipped recipe; shipped: {sorted(recipes)}")


def check_imports(recipe: Recipe) -> None:
    """Every import path the recipe names resolves (task code, custom role classes)."""
    for field in ("tokenizer", "problems", "reward") + ("environment",) * recipe.multi_turn:
        import_object(getattr(recipe.task, field), f"task.{field}")
    for role in recipe.roles.custom:
        import_object(role.cls, f"roles.custom.{role.name}.cls")


def gpus_needed(recipe: Recipe) -> int:
    """GPUs on one node the recipe's topology uses (0: it runs on CPU only)."""
    slots = assign(recipe, recipe.world_size, gpus_per_node=ENOUGH_GPUS).values()
    return max((d + 1 for slot in slots for d in slot.devices), default=0)


def mode(recipe: Recipe) -> str:
    window = recipe.algorithm.window
    if window is None:
        pacing = "fully asynchronous"
    elif window == 1:
        pacing = "on-policy"
    else:
        pacing = f"off-policy (W={window})"
    return f"{recipe.algorithm.kind}, {pacing}" + (", multi-turn" if recipe.multi_turn else "")


def listing() -> str:
    """One line per shipped recipe: name, model, devices, mode."""
    rows = [("recipe", "model", "devices", "mode")]
    for name, path in shipped().items():
        recipe = load_recipe(path)
        gpus = gpus_needed(recipe)
        rows.append((name, recipe.model.name, f"{gpus} GPU" if gpus else "CPU", mode(recipe)))
    return _table(rows)


def topology(recipe: Recipe, gpus_per_node: int | None = None) -> str:
    """Which rank runs which role, on which devices, in which ring."""
    gpus = gpus_needed(recipe) if gpus_per_node is None else gpus_per_node
    slots = assign(recipe, recipe.world_size, gpus_per_node=gpus)
    rows = [("rank", "role", "process", "devices", "ring")]
    for rank, slot in slots.items():
        devices = ",".join(f"cuda:{d}" for d in slot.devices) or "cpu"
        rows.append((str(rank), slot.role, f"{slot.index + 1}/{slot.count}", devices, slot.ring or "-"))
    header = (
        f"{recipe.name}: {recipe.model.name}, {mode(recipe)}, {recipe.steps} versions; "
        f"{recipe.world_size} processes on {f'{gpus} GPU' + 's' * (gpus > 1) if gpus else 'CPU'} "
        "(rank 0 hosts the data plane)"
    )
    return header + "\n" + _table(rows)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
