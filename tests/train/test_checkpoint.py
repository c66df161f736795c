import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from meshy.train import checkpoint
from meshy.train.checkpoint import CorruptCheckpoint
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.trainer import PolicyBatch, PolicyTrainer
from meshy.train.training_config import LossConfig, OptimConfig, ParallelConfig

REPO = Path(__file__).resolve().parents[2]


def run(mode: str, tmp_path: Path, model_name: str, ep: int, saves: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(Path(__file__).with_name("resume_steps.py")), mode, str(tmp_path / "ckpt"), str(tmp_path / mode)]
    cmd += [model_name, str(ep), saves]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((tmp_path / mode).read_text())


@pytest.mark.slow  # two torchrun ranks, twice; the default tier resumes one-process runs
@pytest.mark.parametrize(
    ("model_name", "ep", "saves"), [("qwen3-tiny", 1, "sync"), ("qwen3-tiny-moe", 2, "background")]
)
def test_resuming_a_two_rank_fsdp_trainer_reproduces_the_next_steps_bit_for_bit(tmp_path, model_name, ep, saves):
    """ep = 2: a mixture with its experts split over the ranks (the Qwen3-30B-A3B recipes), its checkpoint
    written in the background (checkpoint.BackgroundSaves) while the next steps train."""
    trained = run("train", tmp_path, model_name, ep, saves)
    saved = checkpoint.latest(tmp_path / "ckpt")
    assert saved.name == "step-00000002"
    manifest = json.loads((saved / checkpoint.MANIFEST).read_text())["files"]
    assert sorted(manifest) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # both ranks' files
    assert all(manifest[name]["bytes"] == (saved / name).stat().st_size for name in manifest)
    resumed = run("resume", tmp_path, model_name, ep, saves)
    assert resumed.pop("refused") == f"checkpoint {tmp_path / 'corrupt'}: __1_0.distcp: checksum mismatch" + (
        " (xxh3-128 differs from the manifest's)"
    )
    assert resumed == trained  # losses of steps 3 and 4, step count and learning rate: identical floats


def test_an_incomplete_checkpoint_is_refused(tmp_path):
    (tmp_path / "step-00000005").mkdir()
    with pytest.raises(CorruptCheckpoint, match="step-00000005: missing manifest manifest.json"):
        checkpoint.load(tmp_path / "step-00000005", trainer=None)
    with pytest.raises(CorruptCheckpoint, match="step-00000006: no such directory"):
        checkpoint.load(tmp_path / "step-00000006", trainer=None)


def trainer(seed: int) -> PolicyTrainer:
    model, _ = build_model(get_model("qwen3-tiny"), ParallelConfig(), device="cpu", seed=seed)
    return PolicyTrainer(model, OptimConfig(lr=1e-3), LossConfig())


def parameters(trainer: PolicyTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def flip_middle_bit(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))


def truncate(file: Path, size: int = 1000) -> None:
    assert file.stat().st_size > size
    file.write_bytes(file.read_bytes()[:size])


@pytest.mark.parametrize(
    ("corrupt", "error"),
    [
        (lambda ckpt: (ckpt / "__0_0.distcp").unlink(), r"__0_0.distcp is missing"),
        (lambda ckpt: truncate(ckpt / "__0_0.distcp"), r"__0_0.distcp is truncated: size 1000 of \d+ bytes"),
        (lambda ckpt: truncate(ckpt / ".metadata"), r"\.metadata is truncated: size 1000 of \d+ bytes"),
        (lambda ckpt: (ckpt / ".metadata").write_bytes(b"x" * 10**6), r"\.metadata has grown: size 1000000 of"),
        (lambda ckpt: flip_middle_bit(ckpt / "__0_0.distcp"), r"__0_0.distcp: checksum mismatch"),
        (lambda ckpt: (ckpt / checkpoint.MANIFEST).unlink(), r"missing manifest manifest.json"),
        (lambda ckpt: truncate(ckpt / checkpoint.MANIFEST, 20), r"manifest.json is unreadable \(JSONDecodeError"),
        (lambda ckpt: (ckpt / checkpoint.MANIFEST).write_text('{"files": {}}'), r"manifest.json is unreadable"),
    ],
    ids=[
        "missing",
        "truncated",
        "metadata-truncated",
        "metadata-grown",
        "bit-flip",
        "no-manifest",
        "torn-manifest",
        "empty-manifest",
    ],
)
def test_a_corrupt_checkpoint_is_refused_before_anything_is_loaded(tmp_path, corrupt, error):
    saved = trainer(seed=0)
    path = checkpoint.save(tmp_path, 3, saved, {"version": 3})
    corrupt(path)
    fresh = trainer(seed=1)
    before = parameters(fresh)
    assert not torch.equal(before[0], parameters(saved)[0])  # so a load would show
    with pytest.raises(CorruptCheckpoint, match=f"checkpoint {path}: {error}"):
        checkpoint.load(path, fresh)
    assert all(torch.equal(a, b) for a, b in zip(parameters(fresh), before, strict=True))


def test_a_sound_checkpoint_loads_after_verification(tmp_path):
    saved = trainer(seed=0)
    path = checkpoint.save(tmp_path, 3, saved, {"version": 3})
    fresh = trainer(seed=1)
    assert checkpoint.load(path, fresh) == {"version": 3}
    assert all(torch.equal(a, b) for a, b in zip(parameters(fresh), parameters(saved), strict=True))


def test_a_single_process_saves_and_loads_without_dcp_s_single_process_warning(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = checkpoint.save(tmp_path, 1, trainer(seed=0), {"version": 1})
        checkpoint.load(path, trainer(seed=1))
    assert [str(w.message) for w in caught if "torch.distributed is disabled" in str(w.message)] == []


def policy_batch(step: int) -> PolicyBatch:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, get_model("qwen3-tiny").vocab_size, (2, 10), generator=g)
    mask = torch.zeros(2, 9)
    mask[:, 4:] = 1.0
    return PolicyBatch(tokens, mask, torch.randn(2, generator=g), rollout_logprobs=torch.randn(2, 9, generator=g) - 2)


def test_a_background_save_keeps_its_step_s_state_while_training_goes_on_and_resumes_bit_for_bit(tmp_path):
    """save returns before the files are written; the steps after it change every parameter meanwhile, and
    the checkpoint still holds the state of its own step: a trainer resumed from it takes the next steps
    with the same losses, bit for bit."""
    trained = trainer(seed=0)
    for step in (1, 2):
        trained.step(policy_batch(step))
    at_save = [p.detach().clone() for p in parameters(trained)]
    saves = checkpoint.BackgroundSaves(tmp_path)
    saves.save(2, trained, {"version": 2})
    losses = [trained.step(policy_batch(step))["loss"] for step in (3, 4)]
    path = saves.wait()
    saves.close()
    assert path == checkpoint.latest(tmp_path) == tmp_path / "step-00000002"
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    resumed = trainer(seed=1)
    assert checkpoint.load(path, resumed) == {"version": 2}  # the manifest checked first
    assert all(torch.equal(a, b) for a, b in zip(parameters(resumed), at_save, strict=True))
    assert [resumed.step(policy_batch(step))["loss"] for step in (3, 4)] == losses


FULL_DISK = """
import resource, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_checkpoint import trainer
from meshy.train import checkpoint
root = Path({root!r})
trained, saves = trainer(seed=0), checkpoint.BackgroundSaves(root)
saves.save(1, trained, {{"version": 1}})
saves.wait()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
saves.save(2, trained, {{"version": 2}})  # returns: the write fails in the background
try:
    saves.save(3, trained, {{"version": 3}})
except checkpoint.CheckpointNotWritten as e:
    print(e)
    sys.exit(3)
"""


def test_a_background_save_that_cannot_write_stops_the_next_save_and_keeps_the_newest_checkpoint(tmp_path):
    """A write that fails (a file size limit standing in for a full disk) is raised by the next save, naming
    the checkpoint and the newest complete one, which is still what a resume takes."""
    code = FULL_DISK.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-3000:]
    assert f"checkpoint {tmp_path / 'step-00000002'}: writing it in the background failed" in result.stdout
    assert f"the newest complete checkpoint is {tmp_path / 'step-00000001'}" in result.stdout
    assert "rank 0: RuntimeError(" in result.stdout and "GB free on its disk" in result.stdout
    assert [p.name for p in checkpoint.saved(tmp_path)] == ["step-00000001"]
    checkpoint.verify(tmp_path / "step-00000001")
