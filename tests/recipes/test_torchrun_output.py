"""`meshy run` names the rank that died from torchrun's own report: a real torchrun whose second worker
is killed."""

import subprocess
import sys

from meshy.recipes.launch.torchrun_output import TorchrunOutput, exit_status

WORKER = """
import os, signal, time
if os.environ["LOCAL_RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def test_the_root_cause_torchrun_reports_is_the_worker_that_died_and_how(tmp_path, capfd):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    output = TorchrunOutput(process)
    assert process.wait(120) == 1
    root = output.finish()
    assert (root.local_rank, root.exit_code) == (1, -9) and root.describe() == "killed by SIGKILL"
    assert "Root Cause (first observed failure)" in capfd.readouterr().err, "torchrun's report is passed through"
    assert exit_status(3) == "exit code 3"


RAISING_WORKER = """
import os, time
if os.environ["LOCAL_RANK"] == "1":
    raise ValueError("the rank's own error")
time.sleep(60)
"""


def test_torchrun_s_own_report_goes_to_a_file_and_a_rank_s_traceback_to_the_terminal(tmp_path, capfd):
    script = tmp_path / "worker.py"
    script.write_text(RAISING_WORKER)
    report = tmp_path / "torchrun.txt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    output = TorchrunOutput(process, report)
    assert process.wait(120) == 1
    root = output.finish()
    assert (root.local_rank, root.exit_code) == (1, 1)
    err = capfd.readouterr().err
    assert 'worker.py", line 4, in <module>' in err and "ValueError: the rank's own error" in err
    assert "Root Cause" not in err and "ChildFailedError" not in err
    assert f"meshy: torchrun's own report of the failure: {report}" in err
    kept = report.read_text()
    assert kept.startswith("Traceback (most recent call last):") and "ChildFailedError" in kept
    assert "Root Cause (first observed failure)" in kept and kept.rstrip().endswith("=" * 60)
