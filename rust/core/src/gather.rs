//! Byte-level gather of segments into one output buffer (parallel memcpy).
