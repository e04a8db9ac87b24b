"""``mmpack pack-stats FILE --capacity N``: pack the lengths in a file and report bins,
efficiency, the lower bound and the time, for the chosen algorithm next to best-fit
decreasing. Reads ``.npy``, ``.txt`` (one length per line), ``.jsonl`` (a column, or one bare
integer per line) and ``.parquet`` (a column; needs pyarrow). ``--plot out.png`` writes a
histogram of bin fill (matplotlib, Agg backend)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from mmpack.errors import MmpackError, PackingArgumentError
from mmpack.packing.pack import ALGORITHMS, pack
from mmpack.packing.result import Packing

#: Files larger than this show a progress bar while they are read.
PROGRESS_BYTES = 8 << 20
_COLUMNS = ("length", "lengths", "num_tokens", "n_tokens", "seq_len", "seqlen", "len")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="lengths: .npy, .txt (one per line), .jsonl or .parquet")
    parser.add_argument("--capacity", type=int, required=True, help="tokens per bin")
    parser.add_argument(
        "--algorithm", default="best_fit_decreasing", choices=ALGORITHMS, help="packing algorithm"
    )
    parser.add_argument(
        "--column", default=None, help="column holding the lengths (.jsonl / .parquet)"
    )
    parser.add_argument(
        "--max-items-per-bin", type=int, default=None, help="at most this many lengths per bin"
    )
    parser.add_argument(
        "--on-oversize",
        default="error",
        choices=("error", "skip", "truncate"),
        help="what to do with lengths over the capacity",
    )
    parser.add_argument("--plot", default=None, help="write a histogram of bin fill to this PNG")
    parser.add_argument("--no-progress", action="store_true", help="never show a progress bar")


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the cli extra
        return None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr)


def _lines(path: str, show: bool) -> Iterator[str]:
    bar = _progress(os.path.getsize(path), f"reading {os.path.basename(path)}", show)
    with open(path, "rb") as fh:
        for raw in fh:
            if bar is not None:
                bar.update(len(raw))
            line = raw.strip()
            if line:
                yield line.decode()
    if bar is not None:
        bar.close()


def _pick_column(names: Iterable[str], column: str | None, path: str) -> str:
    names = list(names)
    if column is not None:
        if column not in names:
            raise PackingArgumentError(
                f"{path} has no column {column!r}; columns: {', '.join(names)}"
            )
        return column
    for name in _COLUMNS:
        if name in names:
            return name
    if len(names) == 1:
        return names[0]
    raise PackingArgumentError(
        f"{path}: say which column holds the lengths with --column; columns: {', '.join(names)}"
    )


def _int64_length(value: int, path: str, k: int) -> int:
    """A length read from line ``k`` of ``path``; beyond int64 is an error naming the line."""
    if not -(2**63) <= value < 2**63:
        raise PackingArgumentError(f"{path}: line {k + 1} has a length beyond int64: {value}")
    return value


def read_lengths(path: str, column: str | None = None, progress: bool = True) -> NDArray[np.int64]:
    """Lengths from a ``.npy``, ``.txt``, ``.jsonl`` or ``.parquet`` file, as ``int64``."""
    show = progress and os.path.getsize(path) > PROGRESS_BYTES
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        arr = np.asarray(np.load(path, allow_pickle=False))
        if arr.ndim != 1:
            raise PackingArgumentError(f"{path}: lengths must be 1-D, got shape {arr.shape}")
        return arr
    if ext == ".txt":
        values = []
        for k, line in enumerate(_lines(path, show)):
            try:
                value = int(line)
            except ValueError:
                raise PackingArgumentError(
                    f"{path}: line {k + 1} is not an integer: {line[:40]!r}"
                ) from None
            values.append(_int64_length(value, path, k))
        return np.array(values, dtype=np.int64)
    if ext == ".jsonl":
        values = []
        col: str | None = column
        for k, line in enumerate(_lines(path, show)):
            obj = json.loads(line)
            if isinstance(obj, dict):
                # The column is chosen once, from the first line: a later line without it is
                # an error, never a silent switch to another column.
                if col is None:
                    col = _pick_column(obj.keys(), column, f"{path} line {k + 1}")
                if col not in obj:
                    raise PackingArgumentError(f"{path}: line {k + 1} has no column {col!r}")
                obj = obj[col]
            if isinstance(obj, bool) or not isinstance(obj, int):
                raise PackingArgumentError(f"{path}: line {k + 1} has no integer length: {obj!r}")
            values.append(_int64_length(obj, path, k))
        return np.array(values, dtype=np.int64)
    if ext == ".parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        name = _pick_column(pf.schema_arrow.names, column, path)
        bar = _progress(pf.metadata.num_rows, "reading row groups", show)
        parts = []
        for g in range(pf.num_row_groups):
            chunk = pf.read_row_group(g, columns=[name]).column(0).to_numpy()
            parts.append(chunk)
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None:
            bar.close()
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    raise PackingArgumentError(
        f"{path}: unknown file type {ext!r}; use .npy, .txt, .jsonl, .parquet"
    )


def _timed(
    lengths: NDArray[Any], args: argparse.Namespace, algorithm: str
) -> tuple[Packing, float]:
    start = time.perf_counter()
    result = pack(
        lengths,
        args.capacity,
        algorithm=algorithm,
        max_items_per_bin=args.max_items_per_bin,
        on_oversize=args.on_oversize,
    )
    return result, time.perf_counter() - start


def _plot(results: list[Packing], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.linspace(0.0, 1.0, 51).tolist()
    for r in results:
        fill = r.bin_loads / r.capacity
        ax.hist(fill, bins=bins, alpha=0.6, label=f"{r.algorithm} ({r.num_bins} bins)")
    ax.set_xlabel("bin fill (load / capacity)")
    ax.set_ylabel("bins")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"bin fill, capacity {results[0].capacity}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    try:
        lengths = read_lengths(args.file, args.column, progress=not args.no_progress)
        algorithms = [args.algorithm]
        if args.algorithm != "best_fit_decreasing":
            algorithms.append("best_fit_decreasing")
        results = [_timed(lengths, args, a) for a in algorithms]
    except (MmpackError, OSError, ValueError) as exc:
        print(f"mmpack pack-stats: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    first = results[0][0]
    print(f"{args.file}: {len(lengths)} lengths, capacity {args.capacity}")
    print(f"lower bound ceil(sum/capacity): {first.lower_bound} bins")
    if len(first.oversize):
        print(f"oversize items ({args.on_oversize}): {len(first.oversize)}")
    header = (
        f"| {'algorithm':<30} | {'bins':>9} | {'over bound':>10} | {'efficiency':>10} "
        f"| {'time':>10} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r, dt in results:
        print(
            f"| {r.algorithm:<30} | {r.num_bins:>9} | {r.num_bins - r.lower_bound:>10} "
            f"| {r.efficiency:>10.4%} | {dt * 1e3:>7.2f} ms |"
        )
    if args.plot:
        try:
            _plot([r for r, _ in results], args.plot)
        except OSError as exc:
            print(f"mmpack pack-stats: --plot: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0
