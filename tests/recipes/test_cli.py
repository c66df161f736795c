import subprocess
import sys


def test_meshy_demo_runs_the_pipeline_end_to_end():
    result = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "demo", "--steps", "2"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "weights versions announced: [1, 2]  (stream audit clean: True)" in result.stdout
    assert "'retired': 32" in result.stdout  # 2 steps x 4 groups x 4 rows, all trained and freed
    assert result.stdout.count("trainer rank 0") == 2 and result.stdout.count("trainer rank 1") == 2


def test_meshy_without_a_command_says_what_it_expects():
    result = subprocess.run([sys.executable, "-m", "meshy.recipes.cli"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "the following arguments are required: command" in result.stderr
