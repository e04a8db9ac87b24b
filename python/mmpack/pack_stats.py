"""``mmpack pack-stats``: placeholder until the packing CLI lands."""
