"""Multi-turn trajectories end to end: `meshy run` of a recipe whose environment role plays them through
the data plane's turns table (real torchrun, real processes, a tiny model from scratch)."""

import json
from collections import Counter
from pathlib import Path

from meshy.recipes.observe.inspect_run import report
from tests.recipes.agent_task import SmallTokenizer
from tests.recipes.test_pipeline import records, run

STEPS, GROUPS, GROUP = 3, 4, 4


def agent_recipe(tmp_path: Path, environments: int = 2, steps: int = STEPS, top: str = "", ppo: bool = False) -> Path:
    """A multi-turn run of the echo task on a tiny model from scratch, with an auditor of every row (GRPO,
    or PPO with a critic)."""
    kind, critic = ("ppo", "\n[roles.critic]\nprocesses = 1\n") if ppo else ("grpo", "")
    audited = ', "advantage", "returns"' if ppo else ""
    path = tmp_path / "recipe.toml"
    path.write_text(f"""{top}
name = "agent-echo"
steps = {steps}
run_dir = "{tmp_path}"

[model]
name = "qwen3-tiny"
overrides = {{ vocab_size = {SmallTokenizer.vocab_size} }}

[task]
tokenizer = "tests.recipes.agent_task:tokenizer"
problems = "tests.recipes.agent_task:problems"
environment = "tests.recipes.agent_task:environment"

[agent]
max_turns = 3
max_tokens = 160
enable_thinking = false

[algorithm]
kind = "{kind}"
group_size = {GROUP}
prompts_per_step = {GROUPS}
pacing = 2
max_staleness = 1  # a group whose trajectories finish late is trained later, by then maybe 2 versions behind

[sampling]
max_new_tokens = 40
context_length = 512
max_in_flight = 64

[roles.environment]
processes = {environments}

[[roles.custom]]
name = "auditor"
cls = "tests.recipes.agent_task:TrajectoryAuditor"
task = "audit"
reads = ["response_ids", "policy_mask", "rollout_logprobs", "token_versions", "finish_reason"{audited}]
{critic}""")
    return path


def test_trajectories_are_played_through_the_turns_table_token_exact_and_trained_once(tmp_path):
    run_dir = run(agent_recipe(tmp_path))
    rows = STEPS * GROUPS * GROUP
    audits = [r for r in records(run_dir, "auditor-0") if r["kind"] == "audit"]
    assert [a for a in audits if a["problems"]] == []
    played = [r for i in range(2) for r in records(run_dir, f"environment-{i}") if r["kind"] == "trajectory"]
    assert len({t["row"] for t in played}) == len(played), "each trajectory finished once"
    by_row = {t["row"]: t for t in played}
    for audit in audits:  # what training got is what the environment played
        assert by_row[audit["row"]]["turns"] == audit["turns"]
        assert by_row[audit["row"]]["finish_reason"] == audit["finish_reason"]
    done = [t for t in played if t["finish_reason"] == "done"]
    assert [t["reward"] for t in done] == [t["turns"] - 1 for t in done], "the environment's state went along"
    assert any(t["turns"] > 1 for t in done)
    reasons = Counter(t["finish_reason"] for t in played)
    assert reasons["done"] and reasons["max-turns"], reasons  # several turns, and the turn limit reached
    assert max(t["turns"] for t in played) == 3
    assert all(t["tool_calls"] == {} for t in played)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for m in metrics for r in m["row_ids"]] + [d["row"] for m in metrics for d in m["dropped"]]
    # (which rows: the first groups to finish; pacing 2 lets a later version's group overtake a slow one)
    assert len(trained) == len(set(trained)) == rows, "each version's trajectories trained once"
    assert set(trained) <= {a["row"] for a in audits} <= set(by_row), "trained as audited, audited as played"
    audit = report(run_dir).splitlines()
    turns = Counter(t["turns"] for t in played)
    line = next(line for line in audit if line.startswith("trajectories "))
    assert line.startswith(
        f"trajectories {len(played)}: turns " + ", ".join(f"{k}: {n}" for k, n in sorted(turns.items()))
    )
    assert "tool calls 0; errors none" in audit
    steppers = [records(run_dir, f"environment-{i}")[-1] for i in range(2)]
    assert all(s["kind"] == "environment" and s["turns"] > 0 for s in steppers), "both processes took steps"


def test_ppo_over_multi_turn_trajectories_steps_gae_over_the_policy_s_tokens_and_trains_the_critic(tmp_path):
    run_dir = run(agent_recipe(tmp_path, ppo=True))
    audits = [r for r in records(run_dir, "auditor-0") if r["kind"] == "audit"]
    assert len(audits) >= STEPS * GROUPS * GROUP and [a for a in audits if a["problems"]] == []
    assert any(a["turns"] > 1 for a in audits), "some trajectories had observations between turns"
    critic = records(run_dir, "critic-0")
    assert critic[-1]["valued"] >= STEPS * GROUPS * GROUP
    assert any(r["kind"] == "critic_step" for r in critic), "the critic trained"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
