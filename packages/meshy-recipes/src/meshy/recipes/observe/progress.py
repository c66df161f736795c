"""What the training role shows and keeps: a live progress line, the metrics' sinks (TensorBoard, experiment
trackers), the reward curve."""

import time
from pathlib import Path

from meshy.recipes.observe.metric_sinks import MetricSinks


class Progress:
    """`earlier`: the metrics a resumed run already has, so its reward curve covers the whole run. `sinks`: where
    each metrics line goes besides metrics.jsonl (the caller closes them)."""

    def __init__(self, run_dir: Path, steps: int, earlier: list[dict], sinks: MetricSinks):
        self.run_dir = run_dir
        self.steps = steps
        self.sinks = sinks
        self.curve = [(m["version"], m["time"], m["reward_mean"]) for m in earlier if m.get("reward_mean") is not None]
        self.eval_curve = [(m["version"], m["time"], m["eval/accuracy"]) for m in earlier if "eval/accuracy" in m]
        self.start = min([t for _, t, _ in self.curve + self.eval_curve], default=time.time())

    def step(self, record: dict) -> None:
        version, elapsed = record["version"], record["time"] - self.start
        self.sinks.log(record)
        hist = record.get("staleness_histogram", {})
        tokens = sum(hist.values())
        staleness = sum(int(k.lstrip(">=")) * v for k, v in hist.items()) / tokens if tokens else 0.0
        reward = record.get("reward_mean")
        if reward is not None:
            self.curve.append((version, record["time"], reward))
        print(
            f"step {version:>4}/{self.steps}  weights v{version}  reward {_fmt(reward)}  staleness {staleness:.2f}  "
            f"{record['tokens_per_s']:>7.0f} tok/s  wait {record['wait_s']:.2f}s  train {record['train_s']:.2f}s  "
            f"publish {record['publish_s']:.2f}s  [{elapsed:.0f}s]",
            flush=True,
        )

    def eval(self, line: dict) -> None:
        """An evaluated version's line of metrics.jsonl (meshy.recipes.usercode.held_out.EvalFigures.metrics)."""
        version = line["version"]
        self.sinks.log(line)
        self.eval_curve.append((version, line["time"], line["eval/accuracy"]))
        passed = "".join(f"  {k[5:]} {v:.3f}" for k, v in line.items() if k.startswith("eval/pass@"))
        print(
            f"eval weights v{version}  accuracy {line['eval/accuracy']:.3f}{passed}  reward {line['eval/reward']:.3f}  "
            f"({line['eval/problems']} held-out problems, {line['eval/seconds']:.1f}s)  "
            f"[{line['time'] - self.start:.0f}s]",
            flush=True,
        )

    def close(self, recipe: str) -> Path | None:
        """Draw the reward curve (and the held-out accuracy's, when the run evaluates), titled with the run's
        directory name and its `recipe`'s name; returns the PNG's path."""
        if not self.curve and not self.eval_curve:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, (by_version, by_time) = plt.subplots(1, 2, figsize=(10, 4))
        for curve, label in ((self.curve, "mean reward of trained rows"), (self.eval_curve, "held-out accuracy")):
            if not curve:
                continue
            versions, times, values = zip(*curve, strict=True)
            by_version.plot(versions, values, label=label, marker="o" if curve is self.eval_curve else None)
            by_time.plot([t - self.start for t in times], values, label=label)
        by_version.set(xlabel="weights version", ylim=(0, 1.05))
        by_time.set(xlabel="seconds", ylim=(0, 1.05))
        by_version.legend(loc="lower right")
        title = f"{self.run_dir.name} (recipe {recipe})"
        figure.suptitle(title)
        figure.tight_layout()
        path = self.run_dir / "reward_curve.png"
        figure.savefig(path, metadata={"Title": title})
        plt.close(figure)
        return path


def _fmt(value: float | None) -> str:
    return "  -  " if value is None else f"{value:.3f}"
