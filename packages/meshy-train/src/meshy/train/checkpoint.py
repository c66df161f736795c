"""Checkpoints with torch.distributed.checkpoint (DCP): model and optimizer (sharded as trained), LR
scheduler, step, every rank's RNG state (CPU, Python and CUDA) and the data-plane cursors the caller hands in.
The model's frozen parameters are not saved: under LoRA (meshy.train.lora) a checkpoint holds the adapters and
their optimizer state, and the base is the model's own, from `model.init` (or the seed), loaded before.

A checkpoint is written under a temporary name and renamed once every rank has finished, so
`latest` never returns a half-written one. Resuming from it reproduces the next step bit for bit.

Before the rename, a manifest records every file's size and xxh3-128 hash (each rank hashes a share of
the files, whichever rank wrote them). `load` checks the manifest before it reads anything, so a torn,
truncated or bit-rotted checkpoint raises CorruptCheckpoint and leaves the trainer untouched.

`BackgroundSaves` writes the same checkpoints while training goes on (DCP's async_save): the state is
copied to host memory before `save` returns, and the files, manifest and rename follow in the background.
"""

import contextlib
import json
import random
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from meshy.dataplane.devices import HOST
from meshy.dataplane.errors import DataPlaneError, SchemaError

_PREFIX = "step-"
MANIFEST = "manifest.json"
_CHUNK = 16 << 20
# What DCP says on every save and load in a process without a process group (a single trainer process),
# even when told so with no_dist=True (torch 2.14): nothing is wrong, and there is no API that avoids it.
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to"


class Trainer(Protocol):
    """What a checkpoint saves and restores (the policy's and the critic's trainers)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    steps: int
    skipped_nonfinite: int


class CorruptCheckpoint(DataPlaneError):
    """A checkpoint whose files are missing, truncated or do not match its manifest; nothing was loaded."""


class CheckpointNotWritten(DataPlaneError):
    """A checkpoint being written in the background failed (a full disk, a lost rank); raised by the next
    save or by close."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _from_rank0(value: Any) -> Any:
    if _world() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(local: dict) -> dict:
    """The union of every rank's dict, on every rank."""
    if _world() == 1:
        return local
    parts: list[dict] = [{}] * _world()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _frozen(model: torch.nn.Module) -> set[str]:
    """The state-dict names of the model's frozen parameters: a LoRA model's base, a tied weight under each of
    its names (DCP's ignore_frozen_params drops only the first)."""
    state = model.state_dict(keep_vars=True)
    return {name for name, value in state.items() if isinstance(value, torch.nn.Parameter) and not value.requires_grad}


def _state(trainer: Trainer, cursors: dict[str, Any]) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
    frozen = _frozen(trainer.model)
    model_state = {name: value for name, value in model_state.items() if name not in frozen}
    rank = _rank()
    return {
        "model": model_state,
        "optim": optim_state,
        "scheduler": trainer.scheduler.state_dict(),
        "progress": {"steps": trainer.steps, "skipped_nonfinite": trainer.skipped_nonfinite},
        "cursors": cursors,
        # Each rank saves (and restores) its own generators under its own key.
        f"rng_rank{rank}": {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": _cuda_rng(trainer)},
    }


def _cuda_rng(trainer: Trainer) -> bytes:
    """The generator state of the CUDA device the model is on (empty off CUDA), as bytes: a checkpoint
    saved on one kind of device loads on the other."""
    device = next(trainer.model.parameters()).device
    return bytes(torch.cuda.get_rng_state(device).tolist()) if device.type == "cuda" else b""


def save(root: str | Path, step: int, trainer: Trainer, cursors: dict[str, Any]) -> Path:
    """Every rank calls this. Returns the checkpoint directory."""
    final, tmp = _begin(Path(root), step)
    with _single_process_quiet():
        dcp.save(_state(trainer, cursors), checkpoint_id=str(tmp))
    _barrier()
    names = _from_rank0(_file_names(tmp) if _rank() == 0 else None)
    files = _gather({name: _file_entry(tmp / name) for name in names[_rank() :: _world()]})
    if _rank() == 0:
        _commit(tmp, final, files)
    _barrier()
    return final


class BackgroundSaves:
    """Checkpoints under `root` written while training goes on. Every rank of the trainer makes one and
    calls each `save` (the first one creates a gloo group for the background's collectives, so they never
    interleave with training's).

    `save` returns once the state is copied to host memory; DCP's async_save then writes the files in a
    thread, and rank 0, whose save returns only after every rank's files and the metadata are written,
    hashes them into the manifest and renames the checkpoint into place (only then does `latest` see it).
    One save at a time: `save` and `wait` first finish the one before and raise its error (a full disk:
    the run stops at its next checkpoint, the newest complete one untouched), so no failure is silent."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._group: dist.ProcessGroup | None = None  # made by the first save, which every rank calls
        # One stager for every save: it keeps its host buffers, so a save copies into them, allocating nothing.
        self._stager = DefaultStager(StagingOptions(False, False, False, False))
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshy-checkpoint")
        self._pending: Future[Path] | None = None

    def save(self, step: int, trainer: Trainer, cursors: dict[str, Any]) -> None:
        self.wait()
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        elif not dist.is_initialized():  # DCP warns from its background thread, where _single_process_quiet cannot
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        final, tmp = _begin(self.root, step)
        written = dcp.async_save(
            _state(trainer, cursors), checkpoint_id=str(tmp), process_group=self._group, async_stager=self._stager
        )
        self._pending = self._finisher.submit(self._finish, written, tmp, final)

    def written(self) -> bool:
        """Whether no save is in flight any more (its outcome is `wait`'s)."""
        return self._pending is None or self._pending.done()

    def wait(self) -> Path | None:
        """Finishes the save in flight; its checkpoint directory (None if there was none)."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        """Finishes the save in flight (raising its error) and stops the background thread."""
        try:
            self.wait()
        finally:
            self._finisher.shutdown()
            self._stager.close()

    @staticmethod
    def _finish(written: Future, tmp: Path, final: Path) -> Path:
        try:
            written.result()
            if _rank() == 0:
                _commit(tmp, final, {name: _file_entry(tmp / name) for name in _file_names(tmp)})
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            free_gb = shutil.disk_usage(final.parent).free / 1e9
            raise CheckpointNotWritten(
                f"checkpoint {final}: writing it in the background failed ({_failures(e)}; {free_gb:.1f} GB free "
                f"on its disk); the newest complete checkpoint is {latest(final.parent) or 'none'}"
            ) from e
        return final


def _failures(error: BaseException) -> str:
    """What failed, per rank for DCP's CheckpointException (its str is every rank's whole traceback)."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {failure!r}" for rank, (failure, _) in sorted(error.failures.items()))
    return repr(error)


def _begin(root: Path, step: int) -> tuple[Path, Path]:
    """The checkpoint's final directory and the empty temporary one it is written to (every rank)."""
    final, tmp = root / f"{_PREFIX}{step:08d}", root / f".{_PREFIX}{step:08d}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    return final, tmp


def _file_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file())


def _commit(tmp: Path, final: Path, files: dict[str, dict[str, Any]]) -> None:
    """Rank 0: the manifest of every file, then the rename that makes the checkpoint visible."""
    (tmp / MANIFEST).write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def saved(root: str | Path) -> list[Path]:
    """Every complete checkpoint under root, oldest first."""
    done = [p for p in Path(root).glob(f"{_PREFIX}*") if p.is_dir() and p.name[len(_PREFIX) :].isdigit()]
    return sorted(done, key=step_of)


def step_of(path: str | Path) -> int:
    """The step a checkpoint was saved at."""
    return int(Path(path).name[len(_PREFIX) :])


def latest(root: str | Path, at_most: int | None = None) -> Path | None:
    """The newest complete checkpoint under root (saved at step `at_most` or before, if given), if any."""
    done = [p for p in saved(root) if at_most is None or step_of(p) <= at_most]
    return done[-1] if done else None


def load(path: str | Path, trainer: Trainer) -> dict[str, Any]:
    """Restore a trainer in place (model, optimizer, scheduler, step, RNG); returns the saved cursors."""
    path = Path(path)
    verify(path)
    state = _state(trainer, {})
    rng_key = f"rng_rank{_rank()}"
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    _check_fits(path, metadata, state["model"])
    state["cursors"] = _saved_cursors(metadata)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        # Not strict without the frozen entries; every other one DCP has read (it raises on a missing one).
        options=StateDictOptions(strict=not _frozen(trainer.model)),
    )
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.steps = state["progress"]["steps"]
    trainer.skipped_nonfinite = state["progress"]["skipped_nonfinite"]
    torch.set_rng_state(state[rng_key]["torch"])
    random.setstate(state[rng_key]["python"])
    device, cuda_rng = next(trainer.model.parameters()).device, state[rng_key].get("cuda", b"")
    if device.type == "cuda" and cuda_rng:
        torch.cuda.set_rng_state(torch.tensor(list(cuda_rng), dtype=torch.uint8, device=HOST), device)
    return state["cursors"]


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP's single-process warning (_SINGLE_PROCESS_WARNING) filtered, and only it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        yield


def _check_fits(path: Path, metadata: dcp.Metadata, model_state: dict[str, Any]) -> None:
    """Raise SchemaError unless the checkpoint holds the model entries the trainer has, of their shapes: a
    full model's, or a LoRA model's adapters of the same targets and rank (a changed model.lora does not
    resume)."""
    saved = {
        key.split(".", 1)[1]: tuple(getattr(entry, "size", ()))
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }
    ours = {name: tuple(getattr(value, "shape", ())) for name, value in model_state.items()}
    differ = sorted(name for name in saved.keys() | ours.keys() if saved.get(name) != ours.get(name))
    if differ:
        shown = ", ".join(f"{name} saved {saved.get(name)}, here {ours.get(name)}" for name in differ[:3])
        raise SchemaError(
            f"checkpoint {path}: its model does not fit the trainer's ({len(differ)} entries differ: {shown}); "
            "a run resumes with the model (and model.lora) it was saved with"
        )


def _saved_cursors(metadata: dcp.Metadata) -> dict[str, Any]:
    """The cursors' structure, so DCP knows which entries to read back."""
    keys = [k.split(".", 1)[1] for k in metadata.state_dict_metadata if k.startswith("cursors.")]
    return dict.fromkeys(keys)


def verify(path: str | Path) -> None:
    """Raise CorruptCheckpoint, on every rank, unless every file in the manifest is there with its size
    and hash. Each rank checks a share of the files; the first problem found (by file name) is raised."""
    path = Path(path)
    try:
        files = _read_manifest(path)
        names = sorted(files)
        problems = {name: _problem(path / name, files[name]) for name in names[_rank() :: _world()]}
    except CorruptCheckpoint as e:
        problems = {"": str(e)}
    problems = {name: problem for name, problem in _gather(problems).items() if problem is not None}
    if problems:
        first = min(problems)
        more = f" (and {len(problems) - 1} more files)" if len(problems) > 1 else ""
        raise CorruptCheckpoint(f"checkpoint {path}: {problems[first]}{more}")


def _file_entry(file: Path) -> dict[str, Any]:
    digest, size = xxhash.xxh3_128(), 0
    with file.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "xxh3_128": digest.hexdigest()}


def _read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    """The manifest's files; its problems raise CorruptCheckpoint with a message `verify` completes."""
    if not path.is_dir():
        raise CorruptCheckpoint("no such directory")
    try:
        data = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpoint(f"missing manifest {MANIFEST} (an incomplete checkpoint)") from None
    try:
        files = json.loads(data)["files"]
        if not (isinstance(files, dict) and ".metadata" in files):
            raise ValueError("expected a files table with a .metadata entry")
        for name, entry in files.items():
            if not (isinstance(entry["bytes"], int) and isinstance(entry["xxh3_128"], str)):
                raise ValueError(f"entry of {name!r}: expected bytes (int) and xxh3_128 (str), got {entry!r}")
    except (ValueError, TypeError, KeyError) as e:
        raise CorruptCheckpoint(f"{MANIFEST} is unreadable ({e!r})") from None
    return files


def _problem(file: Path, expected: dict[str, Any]) -> str | None:
    """What is wrong with one file, or None."""
    try:
        size = file.stat().st_size
        if size != expected["bytes"]:
            kind = "is truncated" if size < expected["bytes"] else "has grown"
            return f"{file.name} {kind}: size {size} of {expected['bytes']} bytes"
        if _file_entry(file)["xxh3_128"] != expected["xxh3_128"]:
            return f"{file.name}: checksum mismatch (xxh3-128 differs from the manifest's)"
    except FileNotFoundError:
        return f"{file.name} is missing"
    except OSError as e:
        return f"{file.name} is unreadable: {e}"
    return None
