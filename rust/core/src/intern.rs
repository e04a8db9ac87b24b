//! Provenance: 128-bit ids and the interning table (first occurrence wins, deterministic order).
