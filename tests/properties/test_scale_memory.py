"""Scale and memory, CI-sized: the cases of ``benches/bench_scale.py`` at 1M
rows / 1M lengths and 200k repeated small operations, each in a fresh interpreter, with
generous bounds on resident memory (no timing assertions). The full 10M / 1M figures come from
``python benches/bench_scale.py``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benches" / "bench_scale.py"

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads VmRSS / VmHWM from /proc (Linux)"
)


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_scale", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_packed_tensor_with_1m_rows_stays_within_memory(bench: ModuleType) -> None:
    r = bench.run_case("packed", 1_000_000, timeout=240)
    assert r["rows"] == 1_000_000
    assert r["physical_segments"] == bench.N_SEGMENTS
    # int64 offsets + indices of ~2M references, a slice, 8 shards, their concat, counts and a
    # pickle: about 0.17 KB a row at 10M rows; 1 KB a row is the generous bound (< 1000 MiB)
    grew = r["peak_rss_mib"] - r["baseline_rss_mib"]
    assert grew < 1000, r
    # the pickle holds the row mapping, not 1M copies of the segments
    assert r["pickle_bytes"] < 64 * 1_000_000


def test_packing_1m_lengths_stays_within_memory(bench: ModuleType) -> None:
    r = bench.run_case("packing", 1_000_000, timeout=240)
    assert r["lengths"] == 1_000_000
    assert all(b > 0 for b in r["bins"].values())
    grew = r["peak_rss_mib"] - r["baseline_rss_mib"]
    assert grew < 500, r  # ~100 bytes per length; 500 is the generous bound


def test_200k_repeated_operations_keep_memory_flat(bench: ModuleType) -> None:
    r = bench.run_case("repeat", 200_000, timeout=240)
    samples = r["rss_samples_mib"]
    assert len(samples) >= 10 and samples[-1][0] == 200_000
    # a leak of one small object per operation would add >= 10 MiB over 180k operations
    assert r["growth_after_warmup_mib"] < 8, samples


def test_bench_scale_quick_smoke(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench_scale.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"packed", "packing", "reference", "repeat"}
    for name in ("packed", "packing", "reference"):
        r = report["results"][name]
        assert r["peak_rss_mib"] >= r["baseline_rss_mib"] > 0
    table = capsys.readouterr().out
    assert "| case | size | baseline RSS MiB | peak RSS MiB |" in table
    assert "RSS growth after warm-up" in table
