"""Plain-Python reference implementations of the systems mmpack replaces, written from
their specifications. They are the oracle for property tests and the baseline for
benchmarks; the fast paths never import them, and they import nothing from mmpack (an oracle
that ran product code could not catch the product's mistakes;
``tests/properties/test_reference_independence.py`` checks it)."""
