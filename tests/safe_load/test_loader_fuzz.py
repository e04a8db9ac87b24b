"""The restricted loader under the differential fuzzer (``support.loader_fuzz``), a short fixed
run: generated and mutated pickles, opcode programs and ``torch.save`` archives, each loaded in
a child under a hard memory limit, must load within their bound or raise a typed error. The long
run is ``make fuzz-loader``."""

from __future__ import annotations

import collections

from support.loader_fuzz import fuzz


def test_short_fuzz_run_holds_the_bound() -> None:
    results, bad = fuzz(seed=0, count=200, timeout=150)
    outcomes = collections.Counter(r.outcome for r in results)
    assert len(results) == 200
    assert not bad, "\n".join(bad[:20])
    # the run exercises every outcome: loads, refusals, corrupt bytes and the memory bound
    assert {"loaded", "UnsafePickleError", "CorruptPickleError", "PickleTooLargeError"} <= set(
        outcomes
    ), outcomes
