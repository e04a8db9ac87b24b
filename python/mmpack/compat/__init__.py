"""Compatibility with the frameworks mmpack replaces parts of.

``mmpack.compat.nemo_rl``: swap mmpack's ``PackedTensor`` into NeMo-RL (``install``), and read
NeMo-RL's pickles with a restricted unpickler (``loads`` / ``load``, implemented in
``mmpack.compat.safe_unpickle``).
"""

#: The NeMo-RL module that defines ``PackedTensor``.
NEMO_RL_MODULE = "nemo_rl.data.multimodal_utils"
