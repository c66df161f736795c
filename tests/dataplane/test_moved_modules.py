"""Modules that moved keep their old import paths for one release, each with a DeprecationWarning that
names the new path (meshy.dataplane.moved_modules)."""

import json
import subprocess
import sys

import pytest

IMPORT_EVERY_OLD_PATH = """
import importlib, json, sys, warnings
import meshy.dataplane, meshy.train, meshy.recipes
from meshy.dataplane.moved_modules import _MovedModules
moved = {old: new for f in sys.meta_path if isinstance(f, _MovedModules) for old, new in f.moved.items()}
seen = {}
for old, new in moved.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    warned = [str(w.message) for w in caught if w.category is DeprecationWarning]
    seen[old] = [module is importlib.import_module(new), warned]
print(json.dumps(seen))
"""


def test_every_old_path_is_the_new_module_and_says_where_it_went():
    out = subprocess.run([sys.executable, "-c", IMPORT_EVERY_OLD_PATH], capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout)
    assert {"meshy.dataplane.rollout", "meshy.train.critic", "meshy.recipes.catalog", "meshy.recipes.run"} <= set(seen)
    for old, (same, warned) in seen.items():
        assert same, f"{old} is not the module it moved to"
        assert len(warned) == 1 and warned[0].startswith(f"{old} moved to meshy."), (old, warned)


def test_an_old_path_still_runs_with_python_m():
    out = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-m", "meshy.recipes.reference"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "meshy.recipes.reference moved to meshy.recipes.recipe.field_reference" in out.stderr
    assert out.stdout.startswith("# Recipe reference")


def test_the_announcement_formats_old_names_still_read_with_a_warning():
    from meshy.dataplane import weights

    with pytest.warns(DeprecationWarning, match="Transport.DISK.format"):
        assert weights.DISK == "hf-safetensors"
    with pytest.warns(DeprecationWarning, match="Transport.COLLECTIVE.format"):
        from meshy.dataplane.weights import COLLECTIVE
    assert COLLECTIVE == "collective"
    published = weights.Published(3, weights.Transport.SHARED_MEMORY, "{}", "0", 0, 0.0)
    with pytest.warns(DeprecationWarning, match="Published.transport"):
        assert published.format == "shared-memory" == published.to_message()["format"]
    with pytest.raises(AttributeError, match="NCCL"):
        weights.NCCL  # noqa: B018
