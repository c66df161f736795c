"""The data plane's README example runs: a producer and two consumers in separate processes."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "packages/meshy-dataplane/examples/producer_consumers.py"


def test_producer_and_consumers_in_separate_processes_ack_every_row_once():
    done = subprocess.run([sys.executable, EXAMPLE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every row acked once: 12 groups of 4" in done.stdout
    groups = [int(g) for g in re.findall(r"consumer-\d: group (\d+),", done.stdout)]
    assert sorted(groups) == list(range(12)), "each group leased by one consumer, once"
