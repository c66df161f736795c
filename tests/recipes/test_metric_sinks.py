"""The [logging] section: wandb, MLflow and trackio beside metrics.jsonl and TensorBoard, each off by default.
Every line goes to each tracker turned on under its own names at its weights version, the recipe is the run's
config, `--resume` carries on the same tracker run, and the trackers are closed (failed, when the run failed).
Offline: wandb in WANDB_MODE=offline read back by its own reader (`wandb leet inspect`), MLflow's file store
by its client, trackio's local store by its SQLiteStorage; no socket leaves this host."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshy.dataplane import SchemaError
from meshy.recipes.observe.metric_sinks import TRACKERS_FILE, MetricSinks
from meshy.recipes.recipe import Recipe, load_recipe
from tests.recipes.offline import block_network
from tests.recipes.test_pipeline import records, repo_env, small_recipe

TRAINED = {"version": 1, "time": 1.8e9, "reward_mean": 0.25, "loss": 0.5, "row_ids": [3, 1], "weights_bytes": None}
EVALUATED = {"version": 0, "time": 1.8e9 + 1, "eval/accuracy": 0.125, "eval/pass@4": 0.5, "eval/problems": 8}
RESUMED = {"version": 2, "time": 1.8e9 + 2, "reward_mean": 0.75, "loss": 0.25, "staleness_histogram": {"0": 4}}


def logging_recipe(tmp_path: Path, table: str) -> Recipe:
    path = tmp_path / "logging.toml"
    path.write_text(f'name = "sinks"\n[logging]\n{table}\n')
    return load_recipe(path)


def log(recipe: Recipe, run_dir: Path, *lines: dict) -> None:
    """One run's attempt: the sinks opened, fed and closed (as a run does, and again when it is resumed)."""
    with MetricSinks.open(recipe, run_dir) as sinks:
        for line in lines:
            sinks.log(line)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb offline with its caches under tmp_path, MLflow without telemetry or a tracking URI of the host's,
    no socket to another host."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the sinks' default store: set here, undone after
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    block_network(monkeypatch.setattr)
    run_dir = tmp_path / "sinks-20261207-120000"
    run_dir.mkdir()
    return run_dir


def wandb_records(run_dir: Path) -> list[dict]:
    """Every record of the run directory's wandb runs (one offline run per attempt), by wandb's own reader."""
    found = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        result = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        found += [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return found


def test_logging_is_off_by_default_and_no_tracker_is_imported_unless_turned_on(tmp_path):
    assert load_recipe().logging.wandb is load_recipe().logging.mlflow is load_recipe().logging.trackio is False
    recipe = tmp_path / "on.toml"
    recipe.write_text('name = "on"\n[logging]\nwandb = true\nmlflow = true\ntrackio = true\n')
    code = (
        "import sys, json\nfrom pathlib import Path\n"
        "from meshy.recipes.recipe import load_recipe\nimport meshy.recipes.roles.training\n"
        "from meshy.recipes.observe.metric_sinks import MetricSinks\n"
        f"load_recipe({str(recipe)!r})\n"
        f"with MetricSinks.open(load_recipe(), Path({str(tmp_path)!r})) as sinks:\n"
        "    sinks.log({'version': 1, 'time': 0.0, 'loss': 0.5})\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'wandb', 'mlflow', 'trackio'})))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == []
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*")), "TensorBoard is written all the same"


@pytest.mark.parametrize("tracker", ["wandb", "mlflow", "trackio"])
def test_a_tracker_turned_on_but_not_installed_is_refused_at_load_naming_the_field_and_the_command(
    tmp_path, monkeypatch, tracker
):
    monkeypatch.setitem(sys.modules, tracker, None)  # what importing a package that is not installed finds
    with pytest.raises(SchemaError) as refused:
        logging_recipe(tmp_path, f"{tracker} = true")
    message = str(refused.value)
    assert message.startswith(f"recipe.logging: {tracker}: true, but the {tracker} package is not installed")
    assert f"uv pip install 'meshy-recipes[{tracker}]'" in message


def test_logging_fields_are_checked_at_load(tmp_path):
    with pytest.raises(SchemaError, match=r"recipe.logging: mlflow_tracking_uri: .* set mlflow = true, or remove"):
        logging_recipe(tmp_path, 'mlflow_tracking_uri = "http://localhost:5000"')
    with pytest.raises(SchemaError, match=r"recipe.logging: project: expected at most 128 characters, none of /"):
        logging_recipe(tmp_path, 'project = "team/rl"')
    with pytest.raises(SchemaError, match=r"recipe.logging: unknown field 'tensorboard'"):
        logging_recipe(tmp_path, "tensorboard = true")


def test_wandb_gets_every_line_at_its_version_and_the_recipe_and_a_resumed_run_carries_on_the_same_run(
    tmp_path, offline
):
    recipe = logging_recipe(tmp_path, 'wandb = true\nproject = "meshy-tests"')
    log(recipe, offline, TRAINED, EVALUATED)
    log(recipe, offline, RESUMED)
    found = wandb_records(offline)
    runs = [r["run"] for r in found if r["type"] == "run"]
    assert len(runs) == 2 and len({r["run_id"] for r in runs}) == 1, "the resumed attempt carries on the same run"
    assert json.loads((offline / TRACKERS_FILE).read_text())["wandb"] == runs[0]["run_id"]
    assert {r["display_name"] for r in runs} == {offline.name} and runs[0]["project"] == "meshy-tests"
    config = runs[0]["config"]["update"]
    assert config["algorithm.group_size"] == 8 and config["logging.wandb"] is True and config["name"] == "sinks"
    assert all(r["metric"]["step_metric"] == "version" for r in found if r["type"] == "metric")
    items = [r["history"]["item"] for r in found if r["type"] == "history"]
    history = [{k: v for k, v in item.items() if not k.startswith("_")} for item in items]
    assert history == [
        {"version": 1, "reward_mean": 0.25, "loss": 0.5},
        {"version": 0, "eval/accuracy": 0.125, "eval/pass@4": 0.5, "eval/problems": 8},
        {"version": 2, "reward_mean": 0.75, "loss": 0.25},
    ]
    assert [r["exit"]["exit_code"] for r in found if r["type"] == "exit"] == [0, 0]


def test_mlflow_keeps_every_line_at_its_version_in_a_file_store_in_the_run_directory_and_resumes_the_run(
    tmp_path, offline
):
    from mlflow import MlflowClient

    recipe = logging_recipe(tmp_path, "mlflow = true")
    log(recipe, offline, TRAINED, EVALUATED)
    run_id = json.loads((offline / TRACKERS_FILE).read_text())["mlflow"]
    log(recipe, offline, RESUMED)
    assert json.loads((offline / TRACKERS_FILE).read_text())["mlflow"] == run_id
    client = MlflowClient(tracking_uri=(offline / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("sinks").experiment_id])
    assert run.info.run_id == run_id and run.info.run_name == offline.name and run.info.status == "FINISHED"
    assert run.data.params["algorithm.group_size"] == "8" and run.data.params["model.name"] == "qwen3-tiny"
    history = {
        name: [(m.step, m.value) for m in client.get_metric_history(run_id, name)]
        for name in ("reward_mean", "loss", "eval/accuracy", "eval/pass_at_4", "eval/problems")
    }
    assert history == {
        "reward_mean": [(1, 0.25), (2, 0.75)],
        "loss": [(1, 0.5), (2, 0.25)],
        "eval/accuracy": [(0, 0.125)],
        "eval/pass_at_4": [(0, 0.5)],  # MLflow refuses "@" in names
        "eval/problems": [(0, 8.0)],
    }
    assert sorted(run.data.metrics) == sorted(history), "no other metric: version and time are step and timestamp"
    assert client.get_metric_history(run_id, "loss")[0].timestamp == 1.8e12


def test_trackio_keeps_every_line_at_its_version_in_its_local_store_and_resumes_the_run_by_name(tmp_path):
    recipe = tmp_path / "logging.toml"
    recipe.write_text('name = "sinks"\n[logging]\ntrackio = true\n')
    run_dir = tmp_path / "sinks-20261207-120000"
    run_dir.mkdir()
    code = (
        "import json, sys\nfrom pathlib import Path\n"
        "from tests.recipes.offline import block_network\nblock_network()\n"
        "from tests.recipes.test_metric_sinks import EVALUATED, RESUMED, TRAINED, log\n"
        "from meshy.recipes.recipe import load_recipe\n"
        "recipe, run_dir = load_recipe(sys.argv[1]), Path(sys.argv[2])\n"
        "log(recipe, run_dir, TRAINED, EVALUATED)\nlog(recipe, run_dir, RESUMED)\n"
        "from trackio.sqlite_storage import SQLiteStorage\n"
        "logs = SQLiteStorage.get_logs('sinks', run_dir.name)\n"
        "print(json.dumps({'runs': SQLiteStorage.get_runs('sinks'), 'config': SQLiteStorage.get_run_config("
        "'sinks', run_dir.name), 'logs': logs}, default=str))"
    )
    trackio_dir = tmp_path / "trackio"
    env = {**repo_env(), "TRACKIO_DIR": str(trackio_dir)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(recipe), str(run_dir)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["runs"] == [run_dir.name], "the resumed attempt carries on the same run"
    assert found["config"]["algorithm.group_size"] == 8 and found["config"]["logging.trackio"] is True
    logs = [{k: v for k, v in line.items() if k not in ("timestamp", "run_id")} for line in found["logs"]]
    assert sorted(logs, key=lambda line: line["step"]) == [
        {"step": 0, "eval/accuracy": 0.125, "eval/pass@4": 0.5, "eval/problems": 8},
        {"step": 1, "reward_mean": 0.25, "loss": 0.5},
        {"step": 2, "reward_mean": 0.75, "loss": 0.25},
    ]
    assert [p.name for p in trackio_dir.glob("*.db")] == ["sinks.db"]


def test_a_tracker_that_cannot_start_stops_the_run_naming_the_field_and_the_others_are_closed_as_failed(
    tmp_path, offline
):
    recipe = logging_recipe(tmp_path, 'wandb = true\nmlflow = true\nmlflow_tracking_uri = "nowhere://tracker"')
    with pytest.raises(RuntimeError, match=r"recipe.logging.mlflow: could not start the mlflow run"):
        MetricSinks.open(recipe, offline)
    assert [r["exit"]["exit_code"] for r in wandb_records(offline) if r["type"] == "exit"] == [1]


def test_a_run_that_fails_marks_its_tracker_runs_failed_with_what_it_logged(tmp_path, offline):
    from mlflow import MlflowClient

    recipe = logging_recipe(tmp_path, "mlflow = true")
    with pytest.raises(ZeroDivisionError), MetricSinks.open(recipe, offline) as sinks:
        sinks.log(TRAINED)
        _ = 1 / 0
    client = MlflowClient(tracking_uri=(offline / "mlruns").as_uri())
    run = client.get_run(json.loads((offline / TRACKERS_FILE).read_text())["mlflow"])
    assert run.info.status == "FAILED" and run.data.metrics["loss"] == 0.5


def test_a_real_run_sends_every_version_and_evaluation_to_every_tracker(tmp_path, monkeypatch):
    """`meshy run` on the default recipe shrunk to 2 versions, with held-out evaluation and all three trackers:
    the last version's line and its evaluation reach each, as metrics.jsonl has them, and each is closed."""
    from mlflow import MlflowClient

    tail = "\n[eval]\nevery = 1\ncount = 4\n\n[logging]\nwandb = true\nmlflow = true\ntrackio = true\n"
    recipe = small_recipe(tmp_path, "1", tail=tail, steps=2)
    trackio_dir = tmp_path / "trackio"
    env = {**repo_env(), "WANDB_MODE": "offline", "TRACKIO_DIR": str(trackio_dir), "MLFLOW_DISABLE_TELEMETRY": "true"}
    result = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "run", str(recipe)],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in env.items() if k != "MLFLOW_TRACKING_URI"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("arithmetic-tiny-")]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = next(m for m in lines if m["version"] == 2 and "loss" in m)
    evaluated = next(m for m in lines if m["version"] == 2 and "eval/accuracy" in m)
    expected = {
        k: v
        for m in (trained, evaluated)
        for k, v in m.items()
        if k not in ("version", "time") and isinstance(v, int | float) and not isinstance(v, bool)
    }
    assert {"loss", "reward_mean", "tokens_per_s", "eval/accuracy", "eval/reward"} <= set(expected)

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("arithmetic-tiny").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    at_2 = {k: next(m.value for m in client.get_metric_history(run.info.run_id, k) if m.step == 2) for k in expected}
    assert at_2 == pytest.approx(expected)

    history = [r["history"]["item"] for r in wandb_records(run_dir) if r["type"] == "history"]
    at_2 = {k: v for item in history if item["version"] == 2 for k, v in item.items() if k in expected}
    assert at_2 == pytest.approx(expected)
    start = next(r for r in records(run_dir, "training-0") if r["kind"] == "start")
    assert not [p for p in Path("/proc").glob("[0-9]*") if _is_wandb_core_of(p, start["pid"])], "wandb-core ended"

    code = (
        "import json, sys\nfrom trackio.sqlite_storage import SQLiteStorage\n"
        "print(json.dumps(SQLiteStorage.get_logs('arithmetic-tiny', sys.argv[1]), default=str))"
    )
    logs = subprocess.run(
        [sys.executable, "-c", code, run_dir.name],
        capture_output=True,
        text=True,
        env={**repo_env(), "TRACKIO_DIR": str(trackio_dir)},
        timeout=120,
        check=True,
    )
    at_2 = {k: v for line in json.loads(logs.stdout) if line["step"] == 2 for k, v in line.items() if k in expected}
    assert at_2 == pytest.approx(expected)


def _is_wandb_core_of(process: Path, parent: int) -> bool:
    try:
        command = (process / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(command) and command[0].endswith(b"wandb-core") and str(parent).encode() in command
