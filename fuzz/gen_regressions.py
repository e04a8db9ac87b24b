"""Regenerate the replay table of rust/core/tests/fuzz_regressions.rs from fuzz/regressions/.

fuzz/regressions/<target>/<name> holds the saved inputs (crashers, minimized, and a few corpus
inputs per target). Run from the repository root: python3 fuzz/gen_regressions.py
"""

from pathlib import Path

TARGETS = ["csr", "pack", "mask", "batch", "gather"]
TEST = Path("rust/core/tests/fuzz_regressions.rs")
BEGIN = "// --- generated replay table (fuzz/gen_regressions.py) ---\n"
END = "// --- end generated ---\n"


def literal(data: bytes) -> str:
    return 'b"' + "".join(f"\\x{b:02x}" for b in data) + '"'


def main() -> None:
    lines = [BEGIN]
    for t in TARGETS:
        files = sorted(Path("fuzz/regressions", t).glob("*"))
        lines.append(f"const {t.upper()}_INPUTS: &[(&str, &[u8])] = &[\n")
        for f in files:
            lines.append(f'    ("{f.name}", {literal(f.read_bytes())}),\n')
        lines.append("];\n")
    lines.append(END)
    text = TEST.read_text()
    a, b = text.index(BEGIN), text.index(END) + len(END)
    TEST.write_text(text[:a] + "".join(lines) + text[b:])


if __name__ == "__main__":
    main()
