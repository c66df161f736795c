import json
import re
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


def test_meshy_recipes_lists_every_shipped_recipe_with_model_devices_and_mode():
    result = subprocess.run([sys.executable, "-m", "meshy.recipes.cli", "recipes"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["recipe", "model", "devices", "mode"]
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line) for line in lines[1:])}
    assert rows["default"] == ["qwen3-tiny", "CPU", "grpo, on-policy"]
    assert rows["qwen3-1.7b-grpo-gsm8k-1gpu"] == ["qwen3-1.7b", "1 GPU", "grpo, on-policy"]
    assert rows["qwen3-30b-a3b-grpo-dapo-8gpu"] == ["qwen3-30b-a3b", "8 GPU", "grpo, off-policy (W=2)"]
    assert rows["qwen3-1.7b-grpo-dapo-8gpu"][2] == "grpo, fully asynchronous"
    assert rows["justrl2-ppo-qwen3-1.7b-8gpu"][2].startswith("ppo")
    assert rows["distill-qwen3-8b-to-1.7b-8gpu"][2].startswith("distill")
    assert {"minicpm5-1b", "minicpm5-2b", "qwen3-8b", "smollm2-135m"} <= {model for model, _, _ in rows.values()}


def test_meshy_check_prints_which_rank_runs_which_role_on_which_device_in_which_ring():
    result = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "check", "minicpm5-2b-grpo-ultradata-4gpu"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith("9 processes on 4 GPUs (rank 0 hosts the data plane)")
    table = [line.split() for line in lines[2:]]
    assert table[0] == ["0", "0", "training", "1/4", "cuda:0", "training+inference"]
    assert table[4] == ["0", "4", "inference", "1/4", "cuda:0", "training+inference"]
    assert table[8] == ["0", "8", "rollout", "1/1", "cpu", "-"]


def test_meshy_check_names_what_is_wrong(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[task]\nreward = "meshy.recipes.tasks.math_reward:no_such_reward"\n')
    result = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "check", str(bad)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "task.reward: 'meshy.recipes.tasks.math_reward:no_such_reward': module" in result.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "check", "no-such"], capture_output=True, text=True
    )
    assert "'no-such' is neither a file nor a shipped recipe" in missing.stderr


def test_meshy_inspect_reports_what_each_process_kept_on_its_gpu_after_handing_it_over(tmp_path):
    from meshy.recipes.observe.inspect_run import report

    (tmp_path / "records").mkdir()
    released = [{"kind": "released", "time": 1.0, "allocated": 0, "reserved": r << 20} for r in (2, 6, 4)]
    (tmp_path / "records" / "training-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in released))
    (tmp_path / "records" / "rollout-0.jsonl").write_text(json.dumps({"kind": "start", "time": 0.0}) + "\n")
    text = report(tmp_path)
    assert "training-0: handed its GPU over 3 times, keeping at most 6 MiB reserved" in text
    assert "rollout-0: handed" not in text


def test_meshy_inspect_counts_device_turns_that_overlapped(tmp_path):
    from meshy.recipes.observe.inspect_run import report

    (tmp_path / "records").mkdir()
    ring = "training+critic-0"

    def write(name: str, lines: list[dict]) -> None:
        (tmp_path / "records" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))

    grant = {"kind": "grant", "time": 0.0, "ring": ring, "payload": None}
    turn = {"kind": "device_turn", "time": 0.0, "ring": ring}
    write("training-0", [{**grant, "seq": 1, "holder": "training"}, {**turn, "seq": 1, "start": 1.0, "end": 2.0}])
    write("critic-0", [{**grant, "seq": 2, "holder": "critic"}, {**turn, "seq": 2, "start": 2.0, "end": 3.0}])
    assert f"ring {ring}: 2 grants {{'training': 1, 'critic': 1}}" in report(tmp_path)
    assert "  turns 2, overlapping 0" in report(tmp_path), "a turn may start as the one before ends"
    write("critic-0", [{**grant, "seq": 2, "holder": "critic"}, {**turn, "seq": 2, "start": 1.5, "end": 3.0}])
    assert "  turns 2, overlapping 1" in report(tmp_path)
    assert "got its GPU" not in report(tmp_path), "grants on the CPU say nothing of free memory"


def test_meshy_inspect_reports_the_least_gpu_memory_a_member_found_free_as_it_got_the_token(tmp_path):
    from meshy.recipes.observe.inspect_run import report

    (tmp_path / "records").mkdir()
    grant = {"kind": "grant", "time": 0.0, "ring": "training+inference-0", "payload": None, "holder": "inference"}
    lines = [{**grant, "seq": 1, "free": 120 * 2**30}, {**grant, "seq": 3, "free": 96 * 2**30 + 2**29}]
    (tmp_path / "records" / "inference-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert "inference-0: got its GPU 2 times, finding at least 96.50 GiB free" in report(tmp_path).splitlines()


def test_meshy_inspect_counts_a_multi_turn_run_s_turns_tool_calls_errors_and_latency(tmp_path):
    from meshy.recipes.observe.inspect_run import report

    (tmp_path / "records").mkdir()

    def trajectory(time, row, turns, reason, calls, errors, seconds):
        return {"kind": "trajectory", "time": time, "row": row, "turns": turns, "finish_reason": reason,
                "tool_calls": calls, "tool_errors": errors, "tool_seconds": seconds, "reward": 0.0}  # fmt: skip

    first = [
        trajectory(1.0, 1, 3, "done", {"calculator": 2}, {}, [0.1, 0.3]),
        trajectory(3.0, 0, 2, "done", {"calculator": 1}, {"timeout": 1}, [5.0]),  # the resumed run's play
    ]
    second = [
        trajectory(2.0, 0, 1, "max-tokens", {}, {}, []),  # played again by the resumed run: not counted
        trajectory(2.5, 2, 3, "max-turns", {"calculator": 1, "": 1}, {"malformed": 1}, [0.2, 0.0]),
    ]
    for name, lines in (("environment-0", first), ("environment-1", second)):
        (tmp_path / "records" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    lines = report(tmp_path).splitlines()
    assert "trajectories 3: turns 2: 1, 3: 2 (mean 2.67); finished done 2, max-turns 1" in lines
    assert "tool calls 5, calculator 4, (malformed) 1; errors timeout 1, malformed 1" in lines
    assert "tool latency: median 0.200 s, p95 5.000 s, max 5.000 s" in lines
