"""The plain pickle format of ``PackedTensor``, an adapter over its state surface
(``mmpack.packed.state``).

Rooms: ``format`` (what ``__reduce_ex__`` writes and ``__setstate__`` reads: ``reduce`` and
``restore``), ``operation`` (which tensors one pickling operation already wrote, and how a value's
segments are planned into groups), ``operation_start`` (how an operation starts),
``group_codec`` (the bytes of a group), ``restore_charge`` (what a restricted load is charged).
Under Ray's serializer, ``format`` hands the segments to ``mmpack.packed.ray_store`` instead.

Nothing is imported here: ``mmpack.packed`` reads ``operation_start`` without torch.
"""
