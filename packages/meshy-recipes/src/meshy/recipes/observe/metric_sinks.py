"""Where the training lead sends each line of metrics.jsonl: TensorBoard, and the experiment trackers the
recipe's [logging] section turns on (wandb, MLflow, trackio).

Every sink gets the same metrics: a line's finite numbers under their own names, at its weights version as
the step (its "version" and "time" are the step and the timestamp, not metrics). A tracker's run is named
after the run directory and gets the recipe as its config; the tracker's library is imported only when the
recipe turns it on. What a run directory started in a tracker is kept in its trackers.json, so that
`meshy run --resume` carries on the same tracker run. The sinks are closed together at the end of the run,
also when it fails (the tracker runs are then marked failed).
"""

import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Protocol

from meshy.recipes.recipe import Recipe

TRACKERS_FILE = "trackers.json"  # in the run directory: each tracker's run (wandb id, MLflow run id, trackio name)
MLFLOW_BATCH = 100  # MLflow takes at most 100 params in one log_batch


class MetricSink(Protocol):
    def log(self, metrics: dict[str, float], version: int, timestamp: float) -> None: ...

    def close(self, failed: bool) -> None: ...


class MetricSinks:
    """Every sink of a run, fed and closed together; a context manager that closes them as the run ends (as
    failed when it ends by an exception)."""

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = sinks

    @classmethod
    def open(cls, recipe: Recipe, run_dir: Path) -> "MetricSinks":
        """TensorBoard in run_dir/tensorboard, and each tracker the recipe turns on. A tracker that cannot
        start (no credentials, no server) stops the run before its first version, naming the recipe field;
        the sinks opened before it are closed first."""
        spec = recipe.logging
        project = spec.project or recipe.name
        config = flat_config(recipe)
        trackers = [
            ("wandb", lambda: WandbSink(run_dir, project, config)),
            ("mlflow", lambda: MlflowSink(run_dir, spec.mlflow_tracking_uri, project, config)),
            ("trackio", lambda: TrackioSink(run_dir, project, config)),
        ]
        sinks = cls([TensorBoardSink(run_dir / "tensorboard")])
        for field, start in trackers:
            if not getattr(spec, field):
                continue
            try:
                sinks.sinks.append(start())
            except Exception as e:
                sinks.close(failed=True)
                raise RuntimeError(f"recipe.logging.{field}: could not start the {field} run: {e}") from e
        return sinks

    def log(self, line: dict[str, Any]) -> None:
        """One line of metrics.jsonl (a version's, or an evaluated version's)."""
        metrics = {
            key: value
            for key, value in line.items()
            if key not in ("version", "time")
            and isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
        }
        for sink in self.sinks:
            sink.log(metrics, line["version"], line["time"])

    def close(self, failed: bool = False) -> None:
        """Flush and close every sink, each even when another's close fails; the first failure is raised
        after all (printed only, when the run failed already)."""
        errors = []
        for sink in self.sinks:
            try:
                sink.close(failed)
            except Exception as e:
                print(f"meshy: closing {type(sink).__name__} failed: {e!r}", file=sys.stderr, flush=True)
                errors.append(e)
        self.sinks = []
        if errors and not failed:
            raise errors[0]

    def __enter__(self) -> "MetricSinks":
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: object) -> None:
        self.close(failed=error is not None)


def flat_config(recipe: Recipe) -> dict[str, Any]:
    """The recipe as one level of dotted names ("algorithm.loss.clip_low": 0.2), as trackers show a run's
    config: tables flattened, arrays kept as lists, anything else that is not a plain value as its text."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, list | tuple):
            flat[prefix] = json.loads(json.dumps(value, default=str))
        else:
            flat[prefix] = value if value is None or isinstance(value, bool | int | float | str) else str(value)

    walk("", dataclasses.asdict(recipe))
    return flat


def _stored(run_dir: Path) -> dict[str, str]:
    path = run_dir / TRACKERS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _store(run_dir: Path, tracker: str, run: str) -> None:
    path = run_dir / TRACKERS_FILE
    partial = path.with_name(f".{TRACKERS_FILE}.{os.getpid()}")
    partial.write_text(json.dumps({**_stored(run_dir), tracker: run}, indent=1) + "\n")
    partial.replace(path)


class TensorBoardSink:
    def __init__(self, directory: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(directory))

    def log(self, metrics: dict[str, float], version: int, timestamp: float) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, version, walltime=timestamp)

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run in run_dir/wandb (WANDB_MODE=offline: kept there for `wandb sync`). Its charts' x axis is
    the "version" metric (define_metric), so that an evaluated version's figures, which arrive after later
    versions' lines, still land at their own version."""

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(
            project=project,
            name=run_dir.name,
            id=_stored(run_dir).get("wandb"),
            resume="allow",
            dir=run_dir,
            config=config,
        )
        _store(run_dir, "wandb", self.run.id)
        self.run.define_metric("*", step_metric="version")

    def log(self, metrics: dict[str, float], version: int, timestamp: float) -> None:
        self.run.log({**metrics, "version": version})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowSink:
    """An MLflow run in experiment `project`. Where: tracking_uri, else MLFLOW_TRACKING_URI, else a file store
    in run_dir/mlruns (MLflow keeps its file store for those who opt in: this one does). MLflow refuses "@" in
    a name: eval/pass@k is logged as eval/pass_at_k."""

    def __init__(self, run_dir: Path, tracking_uri: str, project: str, config: dict[str, Any]):
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=uri)
        stored = _stored(run_dir).get("mlflow")
        if stored is not None:
            self.run_id = stored
            self.client.update_run(stored, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            params = [Param(mlflow_name(key), str(value)) for key, value in config.items()]
            for start in range(0, len(params), MLFLOW_BATCH):
                self.client.log_batch(self.run_id, params=params[start : start + MLFLOW_BATCH])
            _store(run_dir, "mlflow", self.run_id)
        print(f"mlflow: run {self.run_id} ({run_dir.name}) of experiment {project!r} at {uri}", flush=True)

    def log(self, metrics: dict[str, float], version: int, timestamp: float) -> None:
        from mlflow.entities import Metric

        millis = int(timestamp * 1000)
        batch = [Metric(mlflow_name(key), float(value), millis, version) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def mlflow_name(name: str) -> str:
    """A metric or param name as MLflow takes it: "@" as "_at_", any other character it refuses as "_"."""
    return re.sub(r"[^/\w.\- :]", "_", name.replace("@", "_at_"))


class TrackioSink:
    """A trackio run named after the run directory, in trackio's local store (TRACKIO_DIR, by default
    ~/.cache/huggingface/trackio) unless TRACKIO_SPACE_ID or TRACKIO_SERVER_URL sends it elsewhere."""

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]):
        import trackio

        self.trackio = trackio
        resumed = "trackio" in _stored(run_dir)
        self.run = trackio.init(
            project=project, name=run_dir.name, config=config, resume="allow" if resumed else "never", embed=False
        )
        _store(run_dir, "trackio", self.run.name)

    def log(self, metrics: dict[str, float], version: int, timestamp: float) -> None:
        self.run.log(metrics, step=version)

    def close(self, failed: bool) -> None:
        self.trackio.finish()  # the run's, and trackio's record of a current run (else finished again at exit)
