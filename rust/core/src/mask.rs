//! Loss-mask derivation from role / fragment spans, validation, turn-marker parsing.
