"""The restricted loader: read PackedTensor payloads (pickles and ``torch.save`` files written by
NeMo-RL or mmpack) without trusting them. A security boundary: ``loader`` admits only the
globals a payload needs, ``budget`` bounds the memory a payload may cost. See SECURITY.md."""

from mmpack.safe_load.loader import load, loads

__all__ = ["load", "loads"]
