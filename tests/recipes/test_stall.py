"""A run that makes no progress says what it waits for and stops, instead of waiting silently."""

import json
import re
import threading
import time

import pytest
import torch

from meshy.dataplane import FALLBACK, ON_DEMAND, DataPlaneClient, GpuTokenRing
from meshy.dataplane import columns as cols
from meshy.dataplane.devices import HOST
from meshy.recipes.launch.watchdog import Watchdog
from tests.recipes.test_pipeline import meshy_run, small_recipe


def test_a_run_stuck_on_a_lease_nobody_returns_reports_the_stall_and_stops_with_the_resume_command(tmp_path):
    hoarder = '\n[[roles.custom]]\nname = "hoarder"\ncls = "tests.recipes.hoarder:Hoarder"\n'
    recipe = small_recipe(tmp_path, "1", top="stall_after_s = 10\n", tail=hoarder, steps=50)
    start = time.monotonic()
    result = meshy_run(recipe, timeout=240)
    elapsed = time.monotonic() - start
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    report = (run_dir / "logs" / "stall.txt").read_text()
    assert result.returncode != 0, "a stalled run is not a success"
    assert "the run made no progress for 10 s" in result.stderr and report in result.stderr
    assert "task reward (needs response_ids, ground_truth, error)" in report
    assert re.search(r"\d rows leased by hoarder0-\d+-\w+ for \d+ s", report), report
    assert "task train (needs " in report and "rows waiting for reward" in report
    assert "hoarder-0: last record" in report and '"kind": "hoarding"' in report
    assert f"it stalled (what each task waited for: {run_dir / 'logs' / 'stall.txt'})" in result.stderr
    assert f"meshy run --resume {run_dir}" in result.stderr
    assert elapsed < 180


def test_the_stall_report_names_the_columns_rows_wait_for_and_each_role_s_last_record(client, unique, tmp_path):
    """What a run stuck on a column nobody writes (a scorer that went quiet) would report: the rows a
    task cannot take yet, by the columns they miss, and how long ago each role last said anything."""
    table = client.create_table(cols.rollout_table(unique("rollout"))).name
    prompts = [torch.tensor([1, 2, 3], device=HOST)] * 3
    client.put(table, [0, 1, 2], {cols.PROMPT_IDS: prompts, cols.GROUND_TRUTH: ["4", "5", "6"]})
    responses = [torch.tensor([7], device=HOST)] * 2
    client.add_columns(table, [0, 1], {cols.RESPONSE_IDS: responses})
    train = cols.train_with(reward=True)
    assert client.lease(table, train.name, list(train.reads), count=1, timeout=0.1) is None
    held = client.lease(table, cols.GENERATE_TASK.name, list(cols.GENERATE_TASK.reads), count=1, timeout=5)
    assert held is not None and len(held.row_ids) == 1
    (tmp_path / "records").mkdir()
    quiet = {"time": time.time() - 120, "kind": "scoring", "rows": 2}
    (tmp_path / "records" / "scorer-0.jsonl").write_text(json.dumps(quiet) + "\n")

    report = Watchdog(client, [table], tmp_path, stall_after_s=60).report()
    assert report.startswith("meshy: the run made no progress for 60 s"), report
    assert "task generate (needs prompt_ids): 2 rows ready\n    1 rows leased by test-" in report, report
    waits = report[report.index("  task train (needs ") :]
    assert "\n    1 rows waiting for response_ids, rollout_logprobs, token_versions, advantage, reward" in waits
    assert "\n    2 rows waiting for rollout_logprobs, token_versions, advantage, reward" in waits
    assert re.search(r'scorer-0: last record 1[12]\d s ago: \{"kind": "scoring", "rows": 2\}', report), report


def test_the_stall_report_says_who_holds_each_gpu_token_and_who_waits(client, dataplane, secret, unique, tmp_path):
    """A run stuck in a ring (a member that keeps the devices, say an engine hung in its turn) shows as
    the token's holder, how long it has held it, and the members waiting."""
    ring, members = unique("ring"), [("inference", FALLBACK), ("training", ON_DEMAND)]
    inference = GpuTokenRing(client, ring, "inference", members)  # declared: the FALLBACK member holds it
    with DataPlaneClient(dataplane.endpoints, secret, name="training") as other:
        training = GpuTokenRing(other, ring, "training", members)
        asking = threading.Thread(target=training.acquire, args=(30,))
        asking.start()
        deadline = time.monotonic() + 10
        while client.rings_waiting()[ring]["pending"] != ["training"] and time.monotonic() < deadline:
            time.sleep(0.05)
        report = Watchdog(client, [], tmp_path, stall_after_s=60).report()
        line = rf"^  ring {ring}: held by inference for \d+ s \(grant 1\); waiting: training$"
        assert re.search(line, report, re.M), report
        inference.poll()  # hands the token on
        asking.join(timeout=10)
        assert training.holding and client.rings_waiting()[ring]["holder"] == "training"
        training.close()
    inference.close()
    back = client.rings_waiting()[ring]  # training's close handed the token back to the FALLBACK member
    assert back == {"holder": "inference", "seq": 3, "held_s": pytest.approx(0, abs=5), "pending": []}
