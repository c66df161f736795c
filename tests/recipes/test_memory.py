"""A long run does not grow: 10,000 rows through the default pipeline (the measurement of bench/memory.py)."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "memory.py"


@pytest.mark.slow
def test_peak_rss_of_every_process_grows_under_10_percent_from_1k_to_10k_rows(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_memory", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    peaks = bench.measure(10_000, tmp_path)
    assert {"training-0", "inference-0", "rollout-0", "dataplane-controller", "dataplane-storage-0"} <= set(peaks)
    for name, (early, late) in peaks.items():
        assert late - early < 0.10 * early, f"{name}: {early:.0f} MiB at {bench.EARLY_ROWS} rows, {late:.0f} MiB at 10k"
