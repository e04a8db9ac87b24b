"""Helpers shared by test folders (not an oracle: the oracles are in ``reference``)."""
