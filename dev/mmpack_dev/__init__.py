"""mmpack's development package: the main job (``demos``), the synthetic multimodal dataset
writer (``synthetic``) and the Energon test helpers (``energon_testing``).

Used by ``make demo``, the examples, the benchmarks and the tests; never part of the wheel. Run
it from the source tree: ``PYTHONPATH=dev:tests python -m mmpack_dev demo [train|sft|rl] [OPTIONS]``
(``make demo`` does).
"""
