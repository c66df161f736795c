"""Where a run's data plane keeps its rows on disk ([dataplane] durable), and their end with the run.

Each node's servers log to their own directory: the recipe's `dataplane.durable_dir` (a local disk) or the
run directory's dataplane/, under node<N>/. A run that stops keeps them for `meshy run --resume`; a run that
finishes has no use for them, and each node removes its own.
"""

import contextlib
import dataclasses
import shutil
from pathlib import Path

from meshy.dataplane import DataPlaneConfig
from meshy.recipes.recipe import Recipe

RUN_SUBDIR = "dataplane"


def node_rows_dir(recipe: Recipe, run_dir: Path, node: int) -> Path:
    root = Path(recipe.dataplane.durable_dir) / run_dir.name if recipe.dataplane.durable_dir else run_dir / RUN_SUBDIR
    return root / f"node{node}"


def with_rows_dir(config: DataPlaneConfig, recipe: Recipe, run_dir: Path, node: int) -> DataPlaneConfig:
    """The node's data-plane settings with its log directory set (as given when durable is off)."""
    if config.durable == "off":
        return config
    return dataclasses.replace(config, durable_dir=str(node_rows_dir(recipe, run_dir, node)))


def discard_rows(recipe: Recipe, run_dir: Path, node: int) -> None:
    """A finished run's logs on this node (none if the recipe keeps none)."""
    directory = node_rows_dir(recipe, run_dir, node)
    shutil.rmtree(directory, ignore_errors=True)
    with contextlib.suppress(OSError):  # the other nodes' may still be there
        directory.parent.rmdir()
