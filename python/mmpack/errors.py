"""Every error mmpack raises on bad input. All are ``ValueError`` subclasses of ``MmpackError``,
except where NeMo-RL compatibility demands a builtin type (documented at the raising site).
Each area keeps its names in its own section."""

from mmpack._native import (
    # --- shared ---
    IndexOverflowError,
    MmpackError,
    # --- csr / intern ---
    # --- packing ---
    # --- mask / batch ---
    # --- gather ---
)

__all__ = [
    # --- shared ---
    "IndexOverflowError",
    "MmpackError",
    # --- csr / intern ---
    # --- packing ---
    # --- mask / batch ---
    # --- gather ---
    # --- energon (pure Python) ---
]
