"""Integrations with the frameworks mmpack replaces parts of.

``mmpack.compat.nemo_rl``: swap mmpack's ``PackedTensor`` into NeMo-RL (``install``), NeMo-RL's
packer API (``mmpack.compat.nemo_rl.packing``) and the opt-in accelerations of its data path
(``install(accelerate=True)``). Reading NeMo-RL's pickles without trusting them is the restricted
loader's job, ``mmpack.safe_load`` (re-exported as ``mmpack.compat.nemo_rl.loads`` / ``load``).
"""
