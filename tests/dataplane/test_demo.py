"""The demo's roles run on threads: one that fails makes the demo fail, naming it."""

import pytest

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
