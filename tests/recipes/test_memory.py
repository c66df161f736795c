"""A long run does not grow: 10,000 rows through the default pipeline (the measurement of bench/memory.py)."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "memory.py"
ONE_TIME_JUMP_MIB = 160


@pytest.mark.slow
def test_peak_rss_of_no_process_keeps_growing_from_2500_to_10k_rows(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_memory", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    peaks = bench.measure(10_000, tmp_path)
    assert {"training-0", "inference-0", "rollout-0", "dataplane-controller", "dataplane-storage-0"} <= set(peaks)
    for name, (early, late) in peaks.items():
        # Known and not yet explained: rollout's high-water mark sometimes makes one jump of ~128 MiB at a
        # random point of a run (then stays flat); a leak would grow past that bound too.
        bound = max(0.10 * early, ONE_TIME_JUMP_MIB)
        assert late - early < bound, f"{name}: {early:.0f} MiB at {bench.EARLY_ROWS} rows, {late:.0f} MiB at 10k"
