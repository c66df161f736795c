"""`meshy run` names the rank that died from torchrun's own report: a real torchrun whose second worker
is killed."""

import subprocess
import sys

from meshy.recipes.torchrun_output import TorchrunOutput, exit_status

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
