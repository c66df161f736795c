"""`meshy run`: validate a recipe, make its run directory, start exactly one torchrun."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from meshy.dataplane import SchemaError
from meshy.dataplane.security import SECRET_ENV
from meshy.dataplane.server import new_secret
from meshy.recipes.launch import RUN_DIR_ENV
from meshy.recipes.recipe import DEFAULT_RECIPE, Recipe, load_recipe
from meshy.recipes.topology import assign
from meshy.recipes.watchdog import STALL_REPORT
from meshy.train import checkpoint

RECIPE_FILE = "recipe.toml"


def run(recipe_path: str | None, resume: str | None = None) -> int:
    if resume is not None:
        directory = Path(resume)
        saved = directory / RECIPE_FILE
        if not saved.is_file():
            raise SchemaError(f"--resume {directory}: not a run directory (no {RECIPE_FILE})")
        recipe = load_recipe(saved)
    else:
        source = Path(recipe_path) if recipe_path else DEFAULT_RECIPE
        recipe = load_recipe(source)  # every error surfaces here, before any process starts
        directory = Path(recipe.run_dir) / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        directory.mkdir(parents=True)
        shutil.copy(source, directory / RECIPE_FILE)
    print(
        f"meshy: {recipe.name}: {recipe.world_size} processes "
        f"({', '.join(f'{n} x{s.processes}' for n, s in recipe.roles.items())}), run directory {directory}",
        flush=True,
    )
    (directory / "logs" / STALL_REPORT).unlink(missing_ok=True)  # a resumed run's own stall, if any, only
    env = {**os.environ, SECRET_ENV: new_secret().hex(), RUN_DIR_ENV: str(directory.resolve())}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={recipe.world_size}",
        "-m",
        "meshy.recipes.rank",
        str((directory / RECIPE_FILE).resolve()),
    ]
    code = subprocess.run(command, env=env).returncode
    if code != 0:
        print(stopped_report(recipe, directory, code), file=sys.stderr, flush=True)
    return code


def stopped_report(recipe: Recipe, directory: Path, code: int) -> str:
    """What a user needs after a run stopped early: which rank is which role, and how to carry on."""
    ranks = ", ".join(f"{slot.rank} {slot.role}-{slot.index}" for slot in assign(recipe, recipe.world_size).values())
    newest = checkpoint.latest(directory / "checkpoints")
    since = f"its newest checkpoint, {newest.name}" if newest is not None else "the start (no checkpoint yet)"
    stall = directory / "logs" / STALL_REPORT
    cause = f"it stalled (what each task waited for: {stall}); " if stall.is_file() else ""
    return (
        f"meshy: run {directory} stopped before finishing (torchrun exit code {code}); {cause}the report above "
        f"names the first rank that failed (ranks: {ranks}); logs in {directory / 'logs'}.\n"
        f"meshy: continue from {since} with: meshy run --resume {directory}"
    )
