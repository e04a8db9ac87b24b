//! Bin-packing algorithms and constraints.
