"""A run that makes no progress says what it waits for and stops, instead of waiting silently."""

import re
import time

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
    assert "task reward (needs response_ids, ground_truth)" in report
    assert re.search(r"\d rows leased by hoarder0-\d+-\w+ for \d+ s", report), report
    assert "task train (needs " in report and "rows waiting for reward" in report
    assert "hoarder-0: last record" in report and '"kind": "hoarding"' in report
    assert f"it stalled (what each task waited for: {run_dir / 'logs' / 'stall.txt'})" in result.stderr
    assert f"meshy run --resume {run_dir}" in result.stderr
    assert elapsed < 180
