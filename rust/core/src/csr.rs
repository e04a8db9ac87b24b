//! Row offsets / segment indices: validate, slice (compacting physical segments in first-reference order), concat with provenance interning, repeat-interleave, shard, counts.
