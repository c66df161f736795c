import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshy.dataplane import SchemaError
from meshy.train import checkpoint

REPO = Path(__file__).resolve().parents[2]


def run(mode: str, tmp_path: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(Path(__file__).with_name("resume_steps.py")), mode, str(tmp_path / "ckpt"), str(tmp_path / mode)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((tmp_path / mode).read_text())


def test_resuming_a_two_rank_fsdp_trainer_reproduces_the_next_steps_bit_for_bit(tmp_path):
    trained = run("train", tmp_path)
    assert checkpoint.latest(tmp_path / "ckpt").name == "step-00000002"
    resumed = run("resume", tmp_path)
    assert resumed == trained  # losses of steps 3 and 4, step count and learning rate: identical floats


def test_an_incomplete_checkpoint_is_refused(tmp_path):
    (tmp_path / "step-00000005").mkdir()
    with pytest.raises(SchemaError, match="not a complete DCP checkpoint"):
        checkpoint.load(tmp_path / "step-00000005", trainer=None)
