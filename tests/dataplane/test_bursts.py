import pytest

from meshy.dataplane import Bursts, SchemaError
from meshy.dataplane import bursts as bursts_module


def test_a_lease_waits_for_a_burst_until_the_wait_is_over_and_again_after_each_burst(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(bursts_module.time, "monotonic", lambda: now[0])
    bursts = Bursts(rows=16, wait_s=2.0)
    assert bursts.min_count() == 16
    now[0] += 1.9
    assert bursts.min_count() == 16
    now[0] += 0.1
    assert bursts.min_count() == 1, "past the wait it takes what is ready"
    bursts.leased()
    assert bursts.min_count() == 16, "each burst starts the wait again"
    assert Bursts().min_count() == 1, "by default nothing is waited for"


@pytest.mark.parametrize(
    "rows, wait_s, error",
    [
        (0, 1.0, "bursts rows: expected >= 1 rows to wait for, got 0"),
        (4, -1.0, "bursts wait_s: expected finite seconds >= 0, got -1.0"),
        (4, float("inf"), "bursts wait_s: expected finite seconds >= 0, got inf"),
    ],
)
def test_bad_bursts_are_refused_naming_the_field(rows, wait_s, error):
    with pytest.raises(SchemaError, match=error):
        Bursts(rows, wait_s)
