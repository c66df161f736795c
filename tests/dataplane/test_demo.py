"""The demo's roles run on threads: one that fails makes the demo fail, naming it; trainer ranks step together."""

import re
import time

import pytest

from meshy.dataplane import demo
from meshy.dataplane.demo import role_thread


def no_weights() -> None:
    raise TimeoutError("no weights version in 60 s")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_role_that_raises_is_kept_for_the_demo_s_exit_status():
    failures: list[str] = []
    role = role_thread("rollout", no_weights, (), failures)
    role.start()
    role.join()
    assert failures == ["rollout: TimeoutError: no weights version in 60 s"]


def test_a_trainer_rank_that_starts_late_still_gets_its_share_of_every_step(monkeypatch, capsys):
    """Under load one rank can be seconds late to lease. Ranks that did not step together let the early
    one lease, as its next step, the groups the late one waits for: the run then stalled for 60 s and
    failed (seen once in CI). Here rank 0 starts 2 s late; each rank must still train half of each step."""
    on_time = demo.trainer

    def late_rank_0(client, rank, *args):
        if rank == 0:
            time.sleep(2.0)
        on_time(client, rank, *args)

    monkeypatch.setattr(demo, "trainer", late_rank_0)
    assert demo.main(["--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "weights versions announced: [1, 2]  (stream audit clean: True)" in out
    steps = re.findall(r"step (\d)  trainer rank (\d)  groups \[(\d+), (\d+)\]", out)
    assert sorted((int(step), int(rank)) for step, rank, *_ in steps) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for step in (0, 1):  # a step's four groups, two per rank
        groups = sorted(int(g) for s, _, *gs in steps if int(s) == step for g in gs)
        assert groups == list(range(4 * step, 4 * step + 4))
