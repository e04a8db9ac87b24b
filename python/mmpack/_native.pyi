# Hand-written stubs for the Rust extension; checked by mypy.stubtest in `make test`.
# Each area keeps its stubs in its own section.
__version__: str

# --- shared ---
class MmpackError(ValueError): ...
class IndexOverflowError(MmpackError): ...

# --- csr / intern ---
# --- packing ---
# --- mask / batch ---
# --- gather ---
