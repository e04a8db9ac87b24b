"""A restricted loader for PackedTensor payloads: read pickles written by NeMo-RL or mmpack into
``mmpack.PackedTensor`` objects without trusting them.

``loads(data)`` / ``load(file)`` read pickles written by NeMo-RL or mmpack (``pickle`` protocols 0
to 5, ``cloudpickle`` or ``torch.save``; the old three-field ``__dict__`` state and the current
six-field one; values nested in dicts, lists and tuples) into mmpack objects, without
``nemo_rl`` installed and without ``mmpack.compat.nemo_rl.install()``. Both are re-exported as
``mmpack.compat.nemo_rl.loads`` / ``load``.

The bytes run on this package's own unpickler (``mmpack.safe_load.machine``, its opcode
handlers in ``literals``, ``containers``, ``memo`` and ``objects``), which charges
every object each opcode creates to the load's budget before creating it, and admits only the
globals a PackedTensor payload needs, each checked and charged (``mmpack.safe_load.admitted``;
``torch.save`` archives and nested storages: ``mmpack.safe_load.torch_formats``). Any other
global raises :class:`mmpack.errors.UnsafePickleError` naming it (for example ``os.system``)
before anything is called, and so does a use of an admitted name that could allocate from a
size or change what was checked (``bytearray(2**31)``, a tensor record larger than its
storage, the state of a tensor).

Memory: a load may allocate at most ``max_bytes`` (default: 32 times the input's size plus
64 MiB, see ``mmpack.safe_load.budget``); over the bound,
:class:`mmpack.errors.PickleTooLargeError`, raised before the allocation. Bytes that do not
decode (truncated, bit-flipped, length fields beyond the data) raise
:class:`mmpack.errors.CorruptPickleError` with the original error chained. All three are
``pickle.UnpicklingError`` subclasses. Tensors always load onto the CPU.
"""

from __future__ import annotations

import os
from typing import IO, Any

from mmpack.errors import CorruptPickleError, MmpackError, PickleTooLargeError
from mmpack.packed.pickling.restore_charge import RESTORE_CHARGE
from mmpack.safe_load import budget as cost
from mmpack.safe_load.admitted import NEMO_RL_MODULE, Admitted
from mmpack.safe_load.budget import Budget, check_max_bytes
from mmpack.safe_load.machine import Unpickler
from mmpack.safe_load.torch_formats import ZIP_MAGIC, load_archive, load_storage_bytes

__all__ = ["NEMO_RL_MODULE", "load", "loads"]


def loads(data: bytes | bytearray | memoryview, *, max_bytes: int | None = None) -> Any:
    """Unpickle ``data`` (a pickle, or the bytes of a ``torch.save`` file) with PackedTensor
    values coming back as ``mmpack.PackedTensor``.

    ``max_bytes``: the most memory the load may allocate, by default 32 times ``len(data)``
    plus 64 MiB. Raises ``UnsafePickleError`` for any global a PackedTensor payload does not
    need (or a tensor record larger than its storage, a compressed archive entry),
    ``PickleTooLargeError`` for a payload that needs more memory than ``max_bytes``,
    ``CorruptPickleError`` (with the original error chained) for bytes that do not decode,
    and ``TypeError`` for ``data`` that is not bytes-like."""
    if isinstance(data, str) or not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"loads expects bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    budget = Budget(size, max_bytes)
    if type(data) is not bytes:
        budget.charge(cost.BYTES + size, "a copy of the input")
    raw = bytes(data)
    restore_token = RESTORE_CHARGE.set(budget.charge)  # what restoring PackedTensor states builds
    try:
        if raw[:4] == ZIP_MAGIC:
            return load_archive(raw, budget)
        gate = Admitted(budget, nested=load_storage_bytes)
        return Unpickler(raw, budget, gate, "pickle").load()[0]
    except (MmpackError, MemoryError):
        raise  # a MemoryError is the machine's, not the payload's: never disguised as corrupt
    except Exception as exc:  # the decoding boundary: UnpicklingError, EOFError, ValueError, ...
        what = "torch.save archive" if raw[:4] == ZIP_MAGIC else "pickle"
        raise CorruptPickleError(
            f"not a readable {what}: {type(exc).__name__}: {str(exc)[:200]}"
        ) from exc
    finally:
        RESTORE_CHARGE.reset(restore_token)


def load(file: str | os.PathLike[str] | IO[bytes], *, max_bytes: int | None = None) -> Any:
    """``loads`` for a path or a binary file object (a pickle or a ``torch.save`` file). Reading
    the file counts against ``max_bytes``: a longer file is refused before it is read whole."""
    bound = check_max_bytes(max_bytes)
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as fh:
            return loads(_read_within(fh, bound), max_bytes=bound)
    return loads(_read_within(file, bound), max_bytes=bound)


def _read_within(fh: IO[bytes], max_bytes: int | None) -> bytes:
    if max_bytes is None:
        return fh.read()
    # in pieces: ``read(n)`` may allocate n bytes up front, whatever the file holds
    pieces, total = [], 0
    while piece := fh.read(_READ_PIECE):
        total += len(piece)
        if total > max_bytes:
            raise PickleTooLargeError(
                f"refusing a file longer than max_bytes={max_bytes}: reading it alone needs more"
            )
        pieces.append(piece)
    return b"".join(pieces)


_READ_PIECE = 1 << 20
