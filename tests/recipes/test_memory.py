"""A long run does not grow: 10,000 rows through the default pipeline (the measurement of bench/memory.py),
neither in memory nor in the data plane's logs on disk."""

import pytest

from meshy.dataplane import durable_storage, journal
from tests.benches import load_bench


@pytest.mark.slow
def test_peak_rss_of_every_process_grows_under_10_percent_from_1k_to_10k_rows(tmp_path):
    bench = load_bench("memory")
    peaks, (_, disk_mib) = bench.measure(10_000, tmp_path)
    slack = (durable_storage.COMPACT_SLACK_BYTES + journal.COMPACT_SLACK_BYTES) / 2**20
    assert 0 < disk_mib < slack + 4, f"the data plane's logs took {disk_mib:.1f} MiB: compaction bounds them"
    assert {"training-0", "inference-0", "rollout-0", "dataplane-controller", "dataplane-storage-0"} <= set(peaks)
    for name, (early, late) in peaks.items():
        assert late - early < 0.10 * early, f"{name}: {early:.0f} MiB at {bench.EARLY_ROWS} rows, {late:.0f} MiB at 10k"
