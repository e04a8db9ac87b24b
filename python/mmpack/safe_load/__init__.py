"""The restricted loader: read PackedTensor payloads (pickles and ``torch.save`` files written by
NeMo-RL or mmpack) without trusting them. A security boundary: ``loader`` admits only the
globals a payload needs, ``budget`` bounds the memory a payload may cost. See SECURITY.md.

The modules: ``loader`` (``loads`` / ``load``), ``machine`` (the unpickler's core and its one
opcode table), its opcode families ``literals``, ``containers``, ``memo`` and ``objects``,
``admitted`` (the gate: the admitted globals and what using them does), ``torch_formats``
(``torch.save`` archives and nested storages), ``budget`` (the memory bound and its charges)
and ``describe`` (payload values in error messages)."""

from mmpack.safe_load.loader import load, loads

__all__ = ["load", "loads"]
