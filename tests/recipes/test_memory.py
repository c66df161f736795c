"""A long run does not grow: 10,000 rows through the default pipeline (the measurement of bench/memory.py)."""

import pytest

from tests.benches import load_bench


@pytest.mark.slow
def test_peak_rss_of_every_process_grows_under_10_percent_from_1k_to_10k_rows(tmp_path):
    bench = load_bench("memory")
    peaks = bench.measure(10_000, tmp_path)
    assert {"training-0", "inference-0", "rollout-0", "dataplane-controller", "dataplane-storage-0"} <= set(peaks)
    for name, (early, late) in peaks.items():
        assert late - early < 0.10 * early, f"{name}: {early:.0f} MiB at {bench.EARLY_ROWS} rows, {late:.0f} MiB at 10k"
