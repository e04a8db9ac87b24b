"""Packed SFT batches and loss-mask validation: mmpack vs the plain-torch reference, one run.

Rows (median wall time over the repeats, same inputs on both sides):

* ``pack_samples``: 64 samples of 16-400 tokens, 2-6 alternating user/assistant messages each,
  a ``pixel_values`` PackedTensor (dedup-enabled) on every third sample, into one pack
  (``pad_to_multiple_of=8``, ``cp_size=2``), in both loss-mask modes. Reference: the per-sample
  torch builder in ``tests/reference/batch.py`` with NeMo-RL's PackedTensor
  (``tests/reference/packed_tensor.py``); mmpack: one native call plus ``mmpack.PackedTensor``.
  Every field (``labels``, ``loss_mask``, ``token_mask``, ...) is compared before timing.
* ``pad_samples``: the same samples as padded rows ``[64, L]`` (``pad_to_multiple_of=8``).
* ``micro_batch``: the samples as 4 packs of 16, joined into one micro-batch padded to a fixed
  length (``pad_to_length``), as a pipeline-parallel step takes them.
* ``masks.validate`` of a 1M-token mask (int64, uint8 and bool torch tensors, all valid, so
  every value is read; a bool mask cannot hold a bad value, so only its length is checked).
  Reference: elementwise torch checks with the first bad position
  (``tests/reference/masks.py``, ``validate``).

torch runs on one thread by default (``--torch-threads``): on the shared 2-core machine its
multi-threaded kernels were 3-40x *slower* under load, so one thread is the faster and steadier
baseline; mmpack's calls are single-threaded too.

Usage: ``python benches/bench_batch.py [--quick] [--repeats N] [--torch-threads N]``.
Prints a markdown table and writes ``bench-results/bench_batch.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The plain-Python references live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import numpy as np
import torch
from mmpack import PackedTensor
from mmpack.batch import EncodedSample, PackedBatch, masks, micro_batch, pack_samples
from mmpack.batch.padded import PaddedBatch, pad_samples
from reference import batch as ref_batch
from reference import masks as ref_masks
from reference.packed_tensor import PackedTensor as RefPackedTensor


def _median(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _same_media(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The same media reaches the model: per key, the materialized tensor, and which physical
    segments the rows share."""
    assert sorted(got) == sorted(want)
    for key in got:
        assert torch.equal(got[key].as_tensor(), want[key].as_tensor()), key
        assert list(got[key]._segment_indices) == list(want[key]._segment_indices), key


def _samples(n: int, seed: int = 0) -> tuple[list[EncodedSample], list[EncodedSample]]:
    """The same samples twice: media as mmpack PackedTensors, and as reference ones."""
    rng = np.random.default_rng(seed)
    fast: list[EncodedSample] = []
    ref: list[EncodedSample] = []
    for i in range(n):
        length = int(rng.integers(16, 401))
        n_msgs = int(rng.integers(2, 7))
        cuts = np.sort(rng.choice(np.arange(1, length), size=n_msgs - 1, replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [length]])).tolist()
        roles = ["user" if k % 2 == 0 else "assistant" for k in range(n_msgs)]
        tokens = torch.from_numpy(rng.integers(0, 150_000, size=length, dtype=np.int64))
        mask = torch.from_numpy(masks.from_roles(lengths, roles).astype(np.int64))
        fast_media = ref_media = None
        if i % 3 == 0:
            image = torch.randn(int(rng.integers(64, 257)), 1176)
            fast_media = {"pixel_values": PackedTensor(image, 0).enable_deduplication()}
            ref_media = {"pixel_values": RefPackedTensor(image, 0).enable_deduplication()}
        common = {"loss_mask": mask, "message_lengths": lengths, "message_roles": roles}
        fast.append(EncodedSample(f"s{i}", tokens, media=fast_media, **common))
        ref.append(EncodedSample(f"s{i}", tokens, media=ref_media, **common))
    return fast, ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    repeats = args.repeats or (3 if args.quick else 50)
    n_samples = 8 if args.quick else 64
    mask_tokens = 10_000 if args.quick else 1_000_000

    fast, ref = _samples(n_samples)
    opts = {"pad_to_multiple_of": 8, "cp_size": 2}
    rows: list[dict[str, Any]] = []
    for mode in (None, "precomputed"):
        # same outputs first, then time
        a = pack_samples(fast, loss_mask_mode=mode, **opts)
        b = ref_batch.pack_samples(ref, loss_mask_mode=mode, **opts)
        for name in PackedBatch._TENSOR_FIELDS:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        _same_media(a.media, b.media)
        t_ref = _median(
            lambda m=mode: ref_batch.pack_samples(ref, loss_mask_mode=m, **opts), repeats
        )
        t_new = _median(lambda m=mode: pack_samples(fast, loss_mask_mode=m, **opts), repeats)
        rows.append(
            {
                "case": f"pack_samples {n_samples} samples, mode={mode!r} "
                f"({int(a.cu_seqlens[-1])} tokens, media on every 3rd)",
                "reference_ms": t_ref * 1e3,
                "mmpack_ms": t_new * 1e3,
                "target": 10,
            }
        )

    # padded rows, and packs joined into one fixed-length micro-batch
    pad_opts = {"pad_to_multiple_of": 8}
    a_rows = pad_samples(fast, **pad_opts)
    b_rows = ref_batch.pad_samples(ref, **pad_opts)
    for name in PaddedBatch._TENSOR_FIELDS:
        assert torch.equal(getattr(a_rows, name), getattr(b_rows, name)), name
    rows.append(
        {
            "case": f"pad_samples {n_samples} samples ({tuple(a_rows.input_ids.shape)} rows)",
            "reference_ms": _median(lambda: ref_batch.pad_samples(ref, **pad_opts), repeats) * 1e3,
            "mmpack_ms": _median(lambda: pad_samples(fast, **pad_opts), repeats) * 1e3,
            "target": 10,
        }
    )
    quarter = max(n_samples // 4, 1)
    packs = [pack_samples(fast[i : i + quarter], **opts) for i in range(0, n_samples, quarter)]
    length = sum(p.input_ids.numel() for p in packs) + 64
    mb_opts = {**opts, "pad_to_length": length}
    ref_packs = [
        ref_batch.pack_samples(ref[i : i + quarter], **opts) for i in range(0, n_samples, quarter)
    ]
    a_mb = micro_batch(packs, **mb_opts)
    b_mb = ref_batch.micro_batch(ref_packs, **mb_opts)
    for name in PackedBatch._TENSOR_FIELDS:
        assert torch.equal(getattr(a_mb, name), getattr(b_mb, name)), name
    _same_media(a_mb.media, b_mb.media)
    rows.append(
        {
            "case": f"micro_batch of {len(packs)} packs (pad_to_length={length})",
            "reference_ms": _median(lambda: ref_batch.micro_batch(ref_packs, **mb_opts), repeats)
            * 1e3,
            "mmpack_ms": _median(lambda: micro_batch(packs, **mb_opts), repeats) * 1e3,
            "target": 1,
        }
    )

    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.int64, torch.uint8, torch.bool):
        mask = (torch.rand(mask_tokens, generator=gen) < 0.5).to(dtype)
        t_ref = _median(lambda m=mask: ref_masks.validate(m, mask_tokens), repeats)
        t_new = _median(lambda m=mask: masks.validate(m, mask_tokens), repeats)
        rows.append(
            {
                "case": f"masks.validate {mask_tokens:,}-token {str(dtype)[6:]} mask",
                "reference_ms": t_ref * 1e3,
                "mmpack_ms": t_new * 1e3,
                "target": 20,
            }
        )

    print("| case | reference (ms) | mmpack (ms) | speedup | target |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        r["speedup"] = r["reference_ms"] / r["mmpack_ms"]
        print(
            f"| {r['case']} | {r['reference_ms']:.3f} | {r['mmpack_ms']:.3f} | "
            f"{r['speedup']:.1f}x | >= {r['target']}x |"
        )
    out = Path("bench-results")
    out.mkdir(exist_ok=True)
    (out / "bench_batch.json").write_text(
        json.dumps(
            {
                "quick": args.quick,
                "repeats": repeats,
                "torch_threads": args.torch_threads,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
