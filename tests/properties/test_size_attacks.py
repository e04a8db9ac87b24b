"""Hostile size arguments that reached an allocator unchecked: each is refused with a typed
error naming the argument, never a process abort, also where the address space is capped."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from mmpack.errors import PackingArgumentError, PickleTooLargeError
from mmpack.packing.pyrandom import shuffle_order


class _LyingIndex:
    """Says 3 once, then a negative count."""

    def __init__(self) -> None:
        self.calls = 0

    def __index__(self) -> int:
        self.calls += 1
        return 3 if self.calls == 1 else -1


@pytest.mark.parametrize(
    "n", [-1, -(2**63), True, 2.5, float("nan"), "3", 2**32, 2**40, 2**63, 2**64, _LyingIndex()]
)
def test_shuffle_order_refuses_a_bad_count_naming_it(n: object) -> None:
    state = random.Random(0).getstate()
    rng = random.Random(0)
    with pytest.raises(PackingArgumentError, match=r"\bn\b"):
        shuffle_order(n, rng)  # type: ignore[arg-type]
    assert rng.getstate() == state  # refused before the generator moved


def test_shuffle_order_still_matches_random_shuffle() -> None:
    expected = list(range(1000))
    random.Random(7).shuffle(expected)
    got = shuffle_order(np.int64(1000), random.Random(7))
    assert got.tolist() == expected
    assert shuffle_order(0, random.Random(7)).tolist() == []


def test_largest_shuffle_count_is_an_error_not_an_abort_under_a_capped_address_space() -> None:
    # 2**32 - 1 items is a 32 GiB permutation; capped 1 GiB above what the child maps, the
    # request is refused on any machine, and it used to abort the process.
    code = textwrap.dedent(
        """
        import random, resource
        from mmpack.errors import PackingArgumentError
        from mmpack.packing.pyrandom import shuffle_order
        vm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize")]
        cap = vm[0] * 1024 + (1 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        try:
            shuffle_order(2**32 - 1, random.Random(0))
        except PackingArgumentError as exc:
            print("refused:", exc)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: invalid packing argument n:" in out.stdout, out.stdout


class _AlwaysLargeInt(int):
    """An ``int`` whose comparisons claim it is never below anything."""

    def __lt__(self, other: object) -> bool:
        return False

    def __gt__(self, other: object) -> bool:
        return True


@pytest.mark.parametrize("module", ["mmpack.safe_load", "mmpack.compat.nemo_rl"])
def test_max_bytes_of_an_int_subclass_is_its_value(module: str) -> None:
    import importlib
    import pickle

    loads = importlib.import_module(module).loads
    with pytest.raises(TypeError, match="max_bytes"):
        loads(pickle.dumps([1, 2]), max_bytes=_AlwaysLargeInt(-5))
    with pytest.raises(PickleTooLargeError):
        loads(pickle.dumps(b"x" * 100_000), max_bytes=_AlwaysLargeInt(10))
    assert loads(pickle.dumps([1, 2]), max_bytes=_AlwaysLargeInt(10**6)) == [1, 2]


def test_micro_batch_past_int32_is_refused_before_reading_every_pack() -> None:
    import time

    from mmpack.batch import EncodedSample, micro_batch, pack_samples
    from mmpack.errors import IndexOverflowError

    sample = EncodedSample(0, np.arange(1, 5), loss_mask=np.ones(4, dtype=bool))
    pack = pack_samples([sample], loss_mask_mode="precomputed", pad_to_multiple_of=2**20)
    # 4096 references to one 2**20-position pack: 2**32 positions, which int32 offsets
    # cannot hold; checking each pack's fields first read all of them (tens of CPU-seconds).
    # CPU time, not wall time: a process waiting for a core on a busy machine spends none.
    start = time.process_time()
    with pytest.raises(IndexOverflowError, match="int32"):
        micro_batch([pack] * 4096, pad_to_multiple_of=2**20)
    assert time.process_time() - start < 2.0
