"""Checkpoints with torch.distributed.checkpoint (DCP): model and optimizer (sharded as trained), LR
scheduler, step, every rank's RNG state and the data-plane cursors the caller hands in.

A checkpoint is written under a temporary name and renamed once every rank has finished, so
`latest` never returns a half-written one. Resuming from it reproduces the next step bit for bit.
"""

import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from meshy.dataplane import SchemaError
from meshy.train.trainer import PolicyTrainer

_PREFIX = "step-"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _state(trainer: PolicyTrainer, cursors: dict[str, Any]) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
    rank = _rank()
    return {
        "model": model_state,
        "optim": optim_state,
        "scheduler": trainer.scheduler.state_dict(),
        "progress": {"steps": trainer.steps, "skipped_nonfinite": trainer.skipped_nonfinite},
        "cursors": cursors,
        # Each rank saves (and restores) its own generators under its own key.
        f"rng_rank{rank}": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }


def save(root: str | Path, step: int, trainer: PolicyTrainer, cursors: dict[str, Any]) -> Path:
    """Every rank calls this. Returns the checkpoint directory."""
    root = Path(root)
    final, tmp = root / f"{_PREFIX}{step:08d}", root / f".{_PREFIX}{step:08d}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(_state(trainer, cursors), checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    _barrier()
    return final


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under root, if any."""
    done = [p for p in Path(root).glob(f"{_PREFIX}*") if p.is_dir() and p.name[len(_PREFIX) :].isdigit()]
    return max(done, key=lambda p: int(p.name[len(_PREFIX) :])) if done else None


def load(path: str | Path, trainer: PolicyTrainer) -> dict[str, Any]:
    """Restore a trainer in place (model, optimizer, scheduler, step, RNG); returns the saved cursors."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise SchemaError(f"checkpoint {path}: not a complete DCP checkpoint (no .metadata)")
    state = _state(trainer, {})
    rng_key = f"rng_rank{_rank()}"
    state["cursors"] = _saved_cursors(path)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.steps = state["progress"]["steps"]
    trainer.skipped_nonfinite = state["progress"]["skipped_nonfinite"]
    torch.set_rng_state(state[rng_key]["torch"])
    random.setstate(state[rng_key]["python"])
    return state["cursors"]


def _saved_cursors(path: Path) -> dict[str, Any]:
    """The cursors' structure, so DCP knows which entries to read back."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    keys = [k.split(".", 1)[1] for k in metadata.state_dict_metadata if k.startswith("cursors.")]
    return dict.fromkeys(keys)
