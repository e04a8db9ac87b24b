"""Plain-Python reference implementations of the systems mmpack replaces, written from
their specifications. They are the oracle for property tests and the baseline for
benchmarks; the fast paths never import them."""
