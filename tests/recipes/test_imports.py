"""What each kind of process imports: every rank of every run, and `meshy run` itself, pays for its imports
on every start (seconds each on 2 cores), so the heavy libraries stay with the processes that use them."""

import json
import subprocess
import sys

HEAVY = ("transfer_queue", "torchtitan", "tensordict", "ray", "matplotlib", "transformers")


def imported_after(code: str) -> set[str]:
    """The HEAVY top-level packages a fresh interpreter has imported after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return set(json.loads(result.stdout.splitlines()[-1])) & set(HEAVY)


def test_meshy_run_validates_a_recipe_and_lays_out_its_processes_without_the_data_plane_or_torchtitan():
    code = (
        "from meshy.recipes import cli\nfrom meshy.recipes.launch import run\n"
        "from meshy.recipes.recipe.catalog import resolve, topology\n"
        "from meshy.recipes.recipe import load_recipe\n"
        "from meshy.recipes.usercode.task_trial import try_task\n"
        "print(topology(load_recipe(resolve('calculator-tiny-cpu'))))\n"
        "for name in ('calculator-tiny-cpu', 'default'):\n"
        "    try_task(load_recipe(resolve(name)))"  # what meshy check and meshy run try before any rank starts
    )
    assert imported_after(code) == set()


def test_a_rank_whose_role_never_trains_does_not_import_torchtitan():
    roles = ("inference", "rollout", "environment", "teacher")
    code = "import meshy.recipes.launch.rank\n" + "".join(f"import meshy.recipes.roles.{role}\n" for role in roles)
    assert imported_after(code) == {"transfer_queue", "tensordict", "ray"}


def test_the_data_plane_package_imports_transfer_queue_only_with_the_client():
    assert imported_after("from meshy.dataplane import Column, DataPlaneConfig, SchemaError") == set()
    assert "transfer_queue" in imported_after("from meshy.dataplane import DataPlaneClient")
