"""What the training role shows and keeps: a live progress line, TensorBoard scalars, the reward curve."""

import math
import time
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter


class Progress:
    """`earlier`: the metrics a resumed run already has, so its reward curve covers the whole run."""

    def __init__(self, run_dir: Path, steps: int, earlier: list[dict]):
        self.run_dir = run_dir
        self.steps = steps
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.curve = [(m["version"], m["time"], m["reward_mean"]) for m in earlier if m["reward_mean"] is not None]
        self.start = self.curve[0][1] if self.curve else time.time()

    def step(self, record: dict) -> None:
        version, elapsed = record["version"], record["time"] - self.start
        for key, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(key, value, version)
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

    def close(self) -> Path | None:
        """Flush TensorBoard and draw the reward curve; returns the PNG's path."""
        self.writer.close()
        if not self.curve:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        versions, times, rewards = zip(*self.curve, strict=True)
        seconds = [t - self.start for t in times]
        figure, (by_version, by_time) = plt.subplots(1, 2, figsize=(10, 4))
        by_version.plot(versions, rewards)
        by_version.set(xlabel="weights version", ylabel="mean reward of trained rows", ylim=(0, 1.05))
        by_time.plot(seconds, rewards)
        by_time.set(xlabel="seconds", ylim=(0, 1.05))
        figure.tight_layout()
        path = self.run_dir / "reward_curve.png"
        figure.savefig(path)
        plt.close(figure)
        return path


def _fmt(value: float | None) -> str:
    return "  -  " if value is None else f"{value:.3f}"
