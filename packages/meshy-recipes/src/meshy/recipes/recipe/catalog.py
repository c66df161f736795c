"""The shipped recipes, by name, and what `meshy recipes` / `meshy check` print about a recipe."""

from pathlib import Path

from meshy.dataplane import SchemaError
from meshy.recipes.recipe.load import load_recipe
from meshy.recipes.recipe.spec import DEFAULT_RECIPE, Recipe
from meshy.recipes.recipe.topology import assign, on_node
from meshy.recipes.usercode.imports import import_object

SHIPPED_DIR = Path(__file__).parents[1] / "recipes"
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
    """GPUs per node the recipe's topology uses (0: it runs on CPU only)."""
    slots = assign(recipe, recipe.world_size, gpus_per_node=ENOUGH_GPUS).values()
    return max((d + 1 for slot in slots for d in slot.devices), default=0)


def devices(recipe: Recipe) -> str:
    """What the recipe runs on: "CPU", "8 GPU", "2 x 8 GPU"."""
    gpus, nodes = gpus_needed(recipe), recipe.topology.nodes
    if not gpus:
        return "CPU" if nodes == 1 else f"{nodes} x CPU"
    return f"{gpus} GPU" if nodes == 1 else f"{nodes} x {gpus} GPU"


def check_nodes(recipe: Recipe, nodes: int | None) -> None:
    """`--nnodes` says what the recipe says (its topology is the one every node computes)."""
    if nodes is not None and nodes != recipe.topology.nodes:
        raise SchemaError(
            f"--nnodes {nodes}: recipe {recipe.name} is laid out for topology.nodes = {recipe.topology.nodes}; "
            f"set nodes = {nodes} in its [topology] to lay it out over {nodes} nodes"
        )


def mode(recipe: Recipe) -> str:
    window = recipe.algorithm.window
    if window is None:
        pacing = "fully asynchronous"
    elif window == 1:
        pacing = "on-policy"
    else:
        pacing = f"off-policy (W={window})"
    lora = recipe.model.lora
    return (
        f"{recipe.algorithm.kind}, {pacing}"
        + (", multi-turn" if recipe.multi_turn else "")
        + (f", LoRA r{lora.rank}" if lora is not None else "")
    )


def listing() -> str:
    """One line per shipped recipe: name, model, devices, mode."""
    rows = [("recipe", "model", "devices", "mode")]
    for name, path in shipped().items():
        recipe = load_recipe(path)
        rows.append((name, recipe.model.name, devices(recipe), mode(recipe)))
    return _table(rows)


def topology(recipe: Recipe, gpus_per_node: int | None = None) -> str:
    """Which node and rank runs which role, on which devices, in which ring; for several nodes, what each
    node's torchrun starts."""
    gpus = gpus_needed(recipe) if gpus_per_node is None else gpus_per_node
    slots = assign(recipe, recipe.world_size, gpus_per_node=gpus)
    rows = [("node", "rank", "role", "process", "devices", "ring")]
    for rank, slot in slots.items():
        placed = ",".join(f"cuda:{d}" for d in slot.devices) or "cpu"
        rows.append((str(slot.node), str(rank), slot.role, f"{slot.index + 1}/{slot.count}", placed, slot.ring or "-"))
    nodes = recipe.topology.nodes
    where = f"{gpus} GPU" + "s" * (gpus > 1) if gpus else "CPU"
    header = (
        f"{recipe.name}: {recipe.model.name}, {mode(recipe)}, {recipe.steps} versions; {recipe.world_size} "
        f"processes on {where if nodes == 1 else f'{nodes} nodes of {where}'} (rank 0 hosts the data plane)"
    )
    text = header + "\n" + _table(rows)
    if nodes > 1:
        for node in range(nodes):
            local = on_node(slots, node)
            ranks = f"rank {local[0].rank}" if len(local) == 1 else f"ranks {local[0].rank}-{local[-1].rank}"
            text += (
                f"\nnode {node}: {ranks}, torchrun --nproc-per-node={len(local)} "
                f"(meshy run ... --nnodes {nodes} --node-rank {node})"
            )
    return text


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
