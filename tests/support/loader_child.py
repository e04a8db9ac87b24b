"""Run payloads through ``mmpack.safe_load.loads`` in a child process under a hard memory limit,
and measure what each load really costs.

``run_payloads(cases)`` starts ``python -m support.loader_child``, which imports and warms the
loader, caps its address space (``RLIMIT_AS``: what it holds then plus :data:`HEADROOM`), then
loads each payload twice: once under ``tracemalloc`` (the peak of the Python allocations it
made) and once without (the growth of the peak resident set, ``VmHWM`` reset through
``/proc/self/clear_refs``, free memory handed back with ``malloc_trim`` between loads). It
prints one JSON line per payload; a payload that kills the child is reported as ``crashed``
and the rest run in a fresh child.

:func:`violations` applies the loader's promise: each payload loads, or raises a typed
``mmpack.errors`` error that no ``MemoryError`` caused, and its peaks stay within the limit it
ran under (``max_bytes``, or the default bound) plus :data:`RSS_OVERHEAD` /
:data:`TRACED_OVERHEAD`.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: What a load may use beyond its limit, whatever the payload: the resident set (allocator
#: arenas and page granularity, the loader's own objects, torch's per-tensor bookkeeping) ...
RSS_OVERHEAD = 8 << 20
#: ... and the Python allocations ``tracemalloc`` sees.
TRACED_OVERHEAD = 1 << 20
#: The child's address space: what it holds after warming up, plus this.
HEADROOM = 1 << 30

_TESTS = str(Path(__file__).resolve().parents[1])
_CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MALLOC_ARENA_MAX": "1",
    "PYTHONPATH": os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p),
}
_STATUS = re.compile(rb"(VmHWM|VmRSS):\s+(\d+) kB")


@dataclass
class Case:
    name: str
    payload: bytes
    max_bytes: int | None
    compare: bool = False  # no globals: a value that loads must equal CPython's


@dataclass
class Result:
    name: str
    size: int
    limit: int
    outcome: str  # "loaded", an exception class name, or "crashed"
    typed: bool = False  # an mmpack.errors error
    memory_error: bool = False  # a MemoryError raised or in the cause chain
    rss: int = 0
    traced: int = 0
    storage: int = 0  # bytes of the storages the value holds (untouched pages count too)
    seconds: float = 0.0
    message: str = ""
    differs: bool = False  # from what CPython's unpickler gives


def limit_of(payload: bytes, max_bytes: int | None) -> int:
    from mmpack.safe_load.budget import DEFAULT_FACTOR, DEFAULT_FLOOR

    return DEFAULT_FACTOR * len(payload) + DEFAULT_FLOOR if max_bytes is None else max_bytes


def violations(results: list[Result]) -> list[str]:
    bad = []
    for r in results:
        why = []
        if r.outcome == "crashed":
            why.append("the child died")
        elif r.memory_error:
            why.append("MemoryError")
        elif r.outcome != "loaded" and not r.typed:
            why.append(f"untyped {r.outcome}")
        if r.differs:
            why.append("differs from CPython's unpickler")
        if r.rss > r.limit + RSS_OVERHEAD:
            why.append(f"peak RSS +{r.rss >> 10} KiB over a limit of {r.limit >> 10} KiB")
        if r.storage > r.limit:
            why.append(
                f"holds {r.storage >> 10} KiB of storages over a limit of {r.limit >> 10} KiB"
            )
        if r.traced > r.limit + TRACED_OVERHEAD:
            why.append(f"traced peak {r.traced >> 10} KiB over a limit of {r.limit >> 10} KiB")
        if why:
            bad.append(f"{r.name} ({r.size} B, {r.outcome}): {', '.join(why)} {r.message[:120]}")
    return bad


def run_payloads(cases: list[Case], timeout: float = 600) -> list[Result]:
    """Each case's result, in order."""
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, case in enumerate(cases):
            path = Path(tmp) / f"{i}.bin"
            path.write_bytes(case.payload)
            paths.append(path)
        start = time.monotonic()
        while len(results) < len(cases):
            todo = range(len(results), len(cases))
            spec = [
                [str(paths[i]), cases[i].max_bytes, cases[i].name, cases[i].compare] for i in todo
            ]
            spec_path = Path(tmp) / "spec.json"
            spec_path.write_text(json.dumps(spec))
            left = max(timeout - (time.monotonic() - start), 10)
            proc = subprocess.run(
                [sys.executable, "-m", "support.loader_child", str(spec_path)],
                capture_output=True,
                text=True,
                timeout=left,
                env={**os.environ, **_CHILD_ENV},
                check=False,
            )
            for line in proc.stdout.splitlines():
                if line.startswith("{"):
                    results.append(Result(**json.loads(line)))
            if proc.returncode != 0 and len(results) < len(cases):
                case = cases[len(results)]
                results.append(
                    Result(
                        case.name,
                        len(case.payload),
                        limit_of(case.payload, case.max_bytes),
                        "crashed",
                        message=f"exit {proc.returncode}: {proc.stderr[-300:]}",
                    )
                )
    return results


# ------------------------------------------------------------------------------ the child


def _status() -> dict[bytes, int]:
    with open("/proc/self/status", "rb") as fh:
        return {k: int(v) << 10 for k, v in _STATUS.findall(fh.read())}


def _settle() -> int:
    """Free what can be freed, reset the peak resident set; the resident set now."""
    gc.collect()
    _TRIM()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status()[b"VmRSS"]


def _libc_trim() -> Any:
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0)


_TRIM = _libc_trim()


def _storage_bytes(value: Any) -> int:
    """The bytes of the distinct storages ``value`` reaches (through containers, PackedTensor
    values and their attributes): a storage torch grew is uninitialized, so no resident page
    shows it."""
    import torch

    seen: set[int] = set()
    storages: dict[int, int] = {}
    todo = [value]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        elif isinstance(obj, torch.storage.TypedStorage):
            s = obj._untyped_storage
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        elif isinstance(obj, dict):
            todo.extend(obj.values())
            todo.extend(obj.keys())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("mmpack"):
            todo.extend(vars(obj).values())
    return sum(storages.values())


def _outcome(loads: Any, data: bytes, max_bytes: int | None) -> tuple[str, bool, bool, str, Any]:
    from mmpack.errors import MmpackError

    try:
        value = loads(data, max_bytes=max_bytes)
    except BaseException as exc:
        chain: BaseException | None = exc
        memory = False
        while chain is not None:
            memory |= isinstance(chain, MemoryError)
            chain = chain.__cause__ or chain.__context__
        return type(exc).__name__, isinstance(exc, MmpackError), memory, str(exc)[:300], None
    return "loaded", False, False, "", value


def _differs(value: Any, data: bytes) -> bool:
    import pickle

    try:
        theirs = pickle.loads(data)
    except Exception:
        return False  # CPython may refuse what the loader reads (a frame it reads loosely)
    try:
        return pickle.dumps(value, protocol=5) != pickle.dumps(theirs, protocol=5)
    except Exception:
        return True


def _warm(loads: Any) -> None:
    """Import and run every path once, so that no first-use import counts against a load."""
    import io
    import pickle
    import warnings

    import mmpack
    import torch

    torch.set_num_threads(1)
    value = mmpack.PackedTensor([torch.ones(3), torch.zeros(2, dtype=torch.int64)], 0)
    buf = io.BytesIO()
    torch.save({"t": torch.arange(4.0), "v": value}, buf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for data in (
            pickle.dumps({"t": torch.ones(2), "v": value, "s": {1}, "b": b"x"}, protocol=2),
            pickle.dumps({"v": value, "f": frozenset({1.5})}, protocol=5),
            pickle.dumps([value], protocol=0),
            buf.getvalue(),
        ):
            loads(data)
        for bad in (b"\x80\x02cos\nsystem\n.", b"\x80\x02(."):
            _outcome(loads, bad, None)


def main(spec_path: str) -> None:
    from mmpack.safe_load import loads

    _warm(loads)
    gc.collect()
    gc.freeze()  # what is alive now is never the payload's: later collections skip it
    held = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (held + HEADROOM, resource.RLIM_INFINITY))
    for path, max_bytes, name, compare in json.loads(Path(spec_path).read_text()):
        data = Path(path).read_bytes()
        limit = limit_of(data, max_bytes)
        _settle()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        value = _outcome(loads, data, max_bytes)[-1]
        traced = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        held = _storage_bytes(value)
        differs = compare and value is not None and _differs(value, data)
        del value
        before = _settle()
        t0 = time.perf_counter()
        outcome, typed, memory, message, value = _outcome(loads, data, max_bytes)
        seconds = time.perf_counter() - t0
        rss = _status()[b"VmHWM"] - before
        del value
        result = Result(name, len(data), limit, outcome, typed, memory, rss, traced, held, seconds)
        result.message = message
        result.differs = differs
        print(json.dumps(result.__dict__), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
