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


def test_meshy_inspect_names_a_directory_that_is_not_a_run(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "inspect", str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "has no metrics.jsonl and no records/; is it a run directory?" in result.stderr


def test_meshy_run_resume_names_a_directory_that_is_not_a_run(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "run", "--resume", str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert f"--resume {tmp_path}: not a run directory (no recipe.toml)" in result.stderr
