"""A differential fuzzer for the restricted loader (``mmpack.safe_load.loads``).

Payloads come from three sources, all seeded: pickles and ``torch.save`` archives of random
values that protocols 0 to 5 write (mmpack and NeMo-RL PackedTensor values, tensors of every
layout, builtin containers); programs of opcodes written by hand (every admitted global called
with good and bad arguments, memoized arguments reused thousands of times, ``BUILD`` and the
container opcodes on every admitted type, frames of right and wrong lengths, deep nesting,
tensor records that fit their storage and ones that do not); and mutations of both (flipped
and inserted bytes, repeated slices, splices, truncations; inside an archive, of its
``data.pkl``). Each runs in a child (``support.loader_child``) under a hard memory limit and
must load within its bound or raise a typed error; a payload without globals that loads must
give what CPython's own unpickler gives.

``python -m support.loader_fuzz --seconds 600 --seed 1`` is the long run (``make fuzz-loader``).
"""

from __future__ import annotations

import argparse
import collections
import io
import pickle
import random
import struct
import sys
import time
import zipfile
from collections.abc import Callable
from typing import Any

from support import pickle_ops as op
from support.loader_child import Case, Result, run_payloads, violations

KIB = 1 << 10
MIB = 1 << 20
LIMITS = [64 * KIB, 1 * MIB, 1 * MIB, 16 * MIB, None]


# ------------------------------------------------------------------------- values pickled


def _value(rng: random.Random, depth: int = 0) -> Any:
    import torch

    kind = rng.randrange(14 if depth < 3 else 7)
    if kind == 0:
        return rng.choice([0, 1, -1, 255, 2**31, -(2**63), 2**70, rng.getrandbits(64)])
    if kind == 1:
        return rng.choice([0.5, float("inf"), -0.0, rng.random()])
    if kind == 2:
        return rng.choice(["", "a", "é€\U0001f600", "x" * rng.randrange(300)])
    if kind == 3:
        return rng.choice([b"", b"\x00\xff", bytes(rng.randrange(300)), bytearray(b"ab")])
    if kind == 4:
        return rng.choice([None, True, False, complex(1, -2)])
    if kind == 5:
        return _tensor(rng)
    if kind == 6:
        return rng.choice([torch.float32, torch.int64, torch.bool])
    items = [_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if kind == 7:
        return items
    if kind == 8:
        return tuple(items)
    if kind == 9:
        return {f"k{i}": v for i, v in enumerate(items)}
    if kind == 10:
        return collections.OrderedDict((i, v) for i, v in enumerate(items))
    if kind == 11:
        return rng.choice([set, frozenset])(range(rng.randrange(40)))
    if kind == 12:
        return _packed(rng)
    return [items, items]  # shared, through the memo


def _tensor(rng: random.Random) -> Any:
    import torch

    dtype = rng.choice([torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.complex64])
    t = torch.zeros(rng.randrange(1, 6), rng.randrange(1, 6), dtype=dtype)
    return rng.choice([t, t[1:], t.t(), t[:, ::2], t.reshape(-1)[:0], t[0, 0]])


def _packed(rng: random.Random) -> Any:
    import mmpack
    import torch

    tensors = [
        torch.arange(rng.randrange(4), dtype=torch.float32) for _ in range(rng.randrange(1, 4))
    ]
    value = mmpack.PackedTensor(tensors, 0)
    if rng.random() < 0.5:
        value = value.enable_deduplication()
    return value


def _write(rng: random.Random, value: Any) -> bytes:
    if rng.random() < 0.25:
        import torch

        buf = io.BytesIO()
        torch.save(value, buf)
        return buf.getvalue()
    return pickle.dumps(value, protocol=rng.randrange(6))


def pickled(rng: random.Random) -> bytes:
    return _write(rng, [_value(rng) for _ in range(rng.randrange(1, 5))])


# ------------------------------------------------------------------------- opcode programs


class _Program:
    """Opcode fragments that each push one value; memo indices handed out in order."""

    def __init__(self, rng: random.Random, archive: bool) -> None:
        self.rng = rng
        self.archive = archive
        self.memo = 0
        self.plain = True  # no globals, no persistent ids: CPython's unpickler must agree

    def memoize(self, frag: bytes) -> bytes:
        if self.rng.random() < 0.5:
            self.memo += 1
            return frag + op.put(self.memo - 1)
        return frag

    def get(self) -> bytes:
        if self.memo and self.rng.random() < 0.9:
            return op.get(self.rng.randrange(self.memo))
        return op.NONE

    def leaf(self) -> bytes:
        rng = self.rng
        return rng.choice(
            [
                lambda: op.int_(rng.choice([0, 7, -5, 2**40, -(2**100), rng.getrandbits(200)])),
                lambda: op.text(rng.choice(["", "abc", "\udc80", "é" * rng.randrange(2000)])),
                lambda: op.bytes_(bytes(rng.randrange(3000))),
                lambda: b"G" + struct.pack(">d", rng.random()),
                lambda: rng.choice([op.NONE, op.TRUE, op.FALSE, op.EMPTY_TUPLE]),
                lambda: b"V" + b"\\u20ac" * rng.randrange(100) + b"\n",
                lambda: b"I" + str(rng.getrandbits(64)).encode() + b"\n",
                lambda: b"\x96" + struct.pack("<Q", 3) + b"abc",
                self.get,
            ]
        )()

    def value(self, depth: int = 0) -> bytes:
        rng = self.rng
        if depth > 3 or rng.random() < 0.35:
            return self.memoize(self.leaf())
        makers: list[Callable[[int], bytes]] = [
            self.container,
            self.admitted,
            self.admitted,
            self.tensor,
            self.packed,
            self.repeated,
            self.amplified,
            self.amplified,
            self.grow,
            self.build,
            self.nested,
        ]
        return self.memoize(rng.choice(makers)(depth))

    def items(self, depth: int, n: int | None = None) -> bytes:
        count = self.rng.randrange(5) if n is None else n
        return b"".join(self.value(depth + 1) for _ in range(count))

    def container(self, depth: int) -> bytes:
        rng = self.rng
        k = rng.randrange(6)
        body = self.items(depth)
        if k == 0:
            return op.EMPTY_LIST + op.MARK + body + op.APPENDS
        if k == 1:
            return op.MARK + body + op.TUPLE
        if k == 2:
            pairs = b"".join(self.leaf() + self.value(depth + 1) for _ in range(rng.randrange(4)))
            return op.EMPTY_DICT + op.MARK + pairs + op.SETITEMS
        if k == 3:
            return op.EMPTY_SET + op.MARK + b"".join(op.int_(i) for i in range(9)) + op.ADDITEMS
        if k == 4:
            return op.MARK + body + op.FROZENSET
        return op.MARK + body + op.LIST

    def global_(self, module: str, name: str) -> bytes:
        self.plain = False
        return op.global_(module, name)

    def admitted(self, depth: int) -> bytes:
        rng = self.rng
        arg = self.value(depth + 1)
        calls = [
            lambda: op.call(self.global_("builtins", "bytes"), arg),
            lambda: op.call(self.global_("builtins", "bytearray"), arg),
            lambda: op.call(self.global_("builtins", "set"), arg),
            lambda: op.call(self.global_("builtins", "frozenset"), arg),
            lambda: op.call(self.global_("builtins", "complex"), arg, self.leaf()),
            lambda: op.call(self.global_("collections", "OrderedDict")),
            lambda: op.call(self.global_("collections", "OrderedDict"), arg),
            lambda: op.call(self.global_("_codecs", "encode"), arg, op.text("latin1")),
            lambda: op.call(self.global_("builtins", "object")),
            lambda: op.call(
                self.global_("copyreg", "_reconstructor"),
                self.global_("mmpack.packed", "PackedTensor"),
                self.global_("builtins", rng.choice(["object", "set"])),
                op.NONE,
            ),
            lambda: self.global_(NEMO, "PackedTensor") + op.EMPTY_TUPLE + op.NEWOBJ,
            lambda: op.call(self.global_("mmpack.packed", "PackedTensor"), arg),
            lambda: op.call(self.global_("torch.storage", "_load_from_bytes"), arg),
            lambda: self.global_("torch", rng.choice(["float32", "FloatStorage", "int8"])),
            lambda: op.call(self.global_("torch", "float32"), arg),
            lambda: self.global_("os", "system"),
        ]
        return rng.choice(calls)()

    def storage(self) -> bytes:
        rng = self.rng
        numel = rng.choice([0, 1, 4, 16])
        if self.archive and rng.random() < 0.7:
            self.plain = False
            return op.archived_storage(str(rng.randrange(3)), numel)
        self.plain = False
        return op.nested_storage(numel)

    def tensor(self, depth: int) -> bytes:
        rng = self.rng
        ndim = rng.randrange(4)
        size = tuple(rng.choice([0, 1, 2, 4, 2**20, 2**40]) for _ in range(ndim))
        stride = tuple(rng.choice([0, 1, 2, 4]) for _ in range(ndim))
        self.plain = False
        return op.tensor(self.storage(), size, stride, rng.choice([0, 0, 1, 3]))

    def packed(self, depth: int) -> bytes:
        """A NeMo-RL PackedTensor: NEWOBJ, then BUILD with a state (sometimes a bad one)."""
        rng = self.rng
        state = op.EMPTY_DICT + op.MARK + op.text("tensors")
        state += op.EMPTY_LIST + op.MARK + self.items(depth, rng.randrange(3)) + op.APPENDS
        state += op.text("dim_to_pack") + op.int_(0) + op.text("pad_to_max_shape") + op.FALSE
        if rng.random() < 0.4:
            state += op.text("_row_offsets") + self.value(depth + 1)
            state += op.text("_segment_indices") + self.value(depth + 1)
        if rng.random() < 0.3:
            state += op.text(rng.choice(["extra", "as_tensor", "__class__"])) + self.leaf()
        state += op.SETITEMS
        new = self.global_(NEMO, "PackedTensor") + op.EMPTY_TUPLE + op.NEWOBJ
        return new + self.memoize(state) + op.BUILD

    def repeated(self, depth: int) -> bytes:
        """An admitted call or a BUILD of memoized arguments, thousands of times into a list."""
        rng = self.rng
        func = self.value(depth + 1) + op.put(self.memo)
        fi = self.memo
        self.memo += 1
        args = op.MARK + self.items(depth, rng.randrange(3)) + op.TUPLE + op.put(self.memo)
        ai = self.memo
        self.memo += 1
        times = rng.choice([10, 500, 5000, 20000])
        tail = rng.choice([op.REDUCE, op.BUILD + op.DUP, op.NEWOBJ])
        body = (op.get(fi) + op.get(ai) + tail + op.APPEND) * times
        return func + op.POP + args + op.POP + op.EMPTY_LIST + body

    def amplified(self, depth: int) -> bytes:
        """An admitted call that copies or builds from a large memoized argument, repeated."""
        rng = self.rng
        n = rng.choice([10, 1000, 30000])
        ints = op.EMPTY_LIST + op.MARK + b"".join(op.int_(300 + i) for i in range(n)) + op.APPENDS
        calls = [
            (self.global_("builtins", "frozenset"), op.MARK + ints + op.TUPLE),
            (self.global_("builtins", "set"), op.MARK + ints + op.TUPLE),
            (self.global_("builtins", "bytes"), op.MARK + op.bytes_(bytes(n)) + op.TUPLE),
            (self.global_("builtins", "bytearray"), op.MARK + op.bytes_(bytes(n)) + op.TUPLE),
            (
                self.global_("_codecs", "encode"),
                op.MARK + op.text("\xff" * n) + op.text("latin1") + op.TUPLE,
            ),
            (
                self.global_("torch.storage", "_load_from_bytes"),
                op.MARK + op.bytes_(op.legacy_storage(rng.choice([1, 256, 4096]))) + op.TUPLE,
            ),
        ]
        func, args = rng.choice(calls)
        times = rng.choice([100, 2000, 20000])
        head = func + op.put(self.memo) + args + op.put(self.memo + 1) + op.EMPTY_LIST
        body = (op.get(self.memo) + op.get(self.memo + 1) + op.REDUCE + op.APPEND) * times
        self.memo += 2
        return head + body

    def grow(self, depth: int) -> bytes:
        """A container opcode on a value of any type."""
        rng = self.rng
        target = self.value(depth + 1)
        item = self.value(depth + 1)
        return target + rng.choice(
            [
                item + op.APPEND,
                op.MARK + item + op.APPENDS,
                self.leaf() + item + op.SETITEM,
                op.MARK + self.leaf() + item + op.SETITEMS,
                op.MARK + item + op.ADDITEMS,
            ]
        )

    def build(self, depth: int) -> bytes:
        return self.value(depth + 1) + self.value(depth + 1) + op.BUILD

    def nested(self, depth: int) -> bytes:
        n = self.rng.choice([2, 50, 99, 100, 101, 5000])
        return self.leaf() + self.rng.choice([op.TUPLE1, op.MARK + op.TUPLE]) * 1 * n


NEMO = "nemo_rl.data.multimodal_utils"


def _frame_body(rng: random.Random, body: bytes) -> bytes:
    if rng.random() < 0.5:
        return body
    cut = rng.randrange(len(body) + 1)
    length = cut + rng.choice([0, 0, 0, -1, 1, 7])
    return b"\x95" + struct.pack("<Q", max(length, 0)) + body[:cut] + body[cut:]


def program(rng: random.Random, archive: bool = False) -> tuple[bytes, bool]:
    """An opcode program, and whether it names no global (CPython must then agree)."""
    prog = _Program(rng, archive)
    body = op.EMPTY_LIST + op.MARK + prog.items(0, rng.randrange(1, 6)) + op.APPENDS
    proto = rng.choice([b"", op.PROTO2, op.PROTO4, op.PROTO5, op.PROTO5, op.PROTO4, b"\x80\x06"])
    return proto + _frame_body(rng, body) + op.STOP, prog.plain


def program_archive(rng: random.Random) -> bytes:
    data_pkl, _ = program(rng, archive=True)
    sizes = [rng.choice([0, 4, 16, 64]) for _ in range(3)]
    return op.archive(data_pkl, {str(i): bytes(n) for i, n in enumerate(sizes)})


# ------------------------------------------------------------------------- mutations


def mutate(rng: random.Random, data: bytes, other: bytes) -> bytes:
    if data[:4] == b"PK\x03\x04" and rng.random() < 0.7:
        return _mutate_archive(rng, data, other)
    raw = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        k = rng.randrange(6)
        at = rng.randrange(len(raw) + 1)
        if k == 0 and raw:
            raw[min(at, len(raw) - 1)] ^= 1 << rng.randrange(8)
        elif k == 1:
            raw[at:at] = bytes([rng.randrange(256)])
        elif k == 2:  # repeat a slice: a memoized call becomes thousands
            end = min(len(raw), at + rng.randrange(1, 12))
            raw[at:at] = raw[at:end] * rng.choice([2, 100, 3000])
        elif k == 3:
            del raw[at : at + rng.randrange(1, 9)]
        elif k == 4:
            start = rng.randrange(len(other) + 1)
            raw[at:at] = other[start : start + rng.randrange(64)]
        else:
            raw[at : at + 4] = struct.pack("<I", rng.choice([2**31, 2**20, 0xFFFFFFFF, 7]))
    return bytes(raw)


def _mutate_archive(rng: random.Random, data: bytes, other: bytes) -> bytes:
    try:
        src = zipfile.ZipFile(io.BytesIO(data))
        entries = {n: src.read(n) for n in src.namelist()}
    except Exception:  # a mutated archive: mutate its bytes instead
        return mutate(rng, data[4:], other)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, raw in entries.items():
            if name.endswith("data.pkl"):
                raw = mutate(rng, raw, other)
            z.writestr(name, raw)
    return out.getvalue()


# ------------------------------------------------------------------------- running


def cases(seed: int, count: int) -> list[Case]:
    rng = random.Random(seed)
    out: list[Case] = []
    seeds: list[bytes] = []
    while len(out) < count:
        k = rng.randrange(5)
        compare = False
        if k == 0 or not seeds:
            data = pickled(rng)
            seeds.append(data)
            name = "pickled"
        elif k in (1, 2):
            data, compare = program(rng)
            seeds.append(data)
            name = "program"
        elif k == 3:
            data = program_archive(rng)
            name = "archive"
        else:
            data = mutate(rng, rng.choice(seeds), rng.choice(seeds))
            name = "mutated"
        out.append(Case(f"{name} #{len(out)} (seed {seed})", data, rng.choice(LIMITS), compare))
    return out


def fuzz(seed: int, count: int, timeout: float = 600) -> tuple[list[Result], list[str]]:
    results = run_payloads(cases(seed, count), timeout=timeout)
    return results, violations(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch", type=int, default=400)
    args = parser.parse_args()
    end = time.monotonic() + args.seconds
    seed = args.seed
    total: list[Result] = []
    bad: list[str] = []
    while time.monotonic() < end:
        results, found = fuzz(seed, args.batch, timeout=max(end - time.monotonic(), 60) + 120)
        total += results
        bad += found
        seed += 1
    outcomes = collections.Counter(r.outcome for r in total)
    worst = max(total, key=lambda r: r.rss - r.limit)
    slowest = max(total, key=lambda r: r.seconds)
    print(f"{len(total)} payloads, seeds {args.seed}..{seed - 1}: {dict(outcomes)}")
    print(f"largest payload {max(r.size for r in total)} B")
    print(f"peak RSS over its limit, worst: {(worst.rss - worst.limit) >> 10} KiB ({worst.name})")
    print(f"peak RSS, largest: {max(r.rss for r in total) >> 10} KiB")
    print(f"traced peak, largest: {max(r.traced for r in total) >> 10} KiB")
    print(f"slowest load: {slowest.seconds:.2f} s ({slowest.name})")
    print(f"violations: {len(bad)}")
    for line in bad[:20]:
        print("  " + line)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
