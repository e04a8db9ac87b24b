//! Packed sequence layout: cu_seqlens, padded cu_seqlens, position ids, flat gathers of token / label / mask arrays.
