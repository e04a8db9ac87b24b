# mmpack developer commands. `make test` and `make demo` work on a fresh machine:
# each creates the virtual environment and installs what it needs from this repo's files.
.DEFAULT_GOAL := test
SHELL := /bin/bash

VENV ?= .venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)
PROFILE ?= ci
# pytest processes (pytest-xdist): the suite is mostly single-threaded Python
PYTEST_WORKERS ?= 2
DEPS_STAMP := $(VENV)/.mmpack-deps
# The pyo3 crate reads this to find the interpreter when `cargo` builds the bindings.
export PYO3_PYTHON := $(abspath $(PY))

$(DEPS_STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -U 'pip>=25.1'
	$(PY) -m pip install -q -c constraints.txt --group test --group lint
	@touch $(DEPS_STAMP)

.PHONY: lock
lock: venv  ## re-pin constraints.txt from the current environment
	$(PY) -m pip install -q --group test --group lint --group bench
	{ sed -n '1,3p' constraints.txt; $(PY) -m pip freeze --exclude mmpack --exclude-editable; } > constraints.tmp
	mv constraints.tmp constraints.txt

.PHONY: venv
venv: $(DEPS_STAMP)

.PHONY: build
build: venv  ## build the extension into the venv with the fast optimised profile (overflow checks on)
	maturin develop --profile $(PROFILE) --locked -q

.PHONY: build-release
build-release: venv
	maturin develop --release --locked -q

# The native class list of python/mmpack/errors.py and the error section of _native.pyi come from
# the error table in rust/py/src/errors.rs; a test fails while they are stale. Errors declared in
# errors.py's own (Python) table need neither a rebuild nor this.
.PHONY: stubs
stubs: build  ## regenerate the error sections of errors.py and _native.pyi from the built extension
	PYTHONPATH=dev$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m mmpack_dev.stubgen

.PHONY: test-rust
test-rust:
	cargo test -p mmpack-core --profile $(PROFILE) --locked

.PHONY: test-python
test-python: build
	$(PY) -m pytest -q -n $(PYTEST_WORKERS)

# Every crate: the workspace (core, bindings, benches) and the fuzz crate, which is its own
# workspace (its checks also compile into the core's tests).
.PHONY: lint
lint: venv
	cargo fmt --all --check
	cargo fmt --all --check --manifest-path fuzz/Cargo.toml
	cargo clippy --workspace --all-targets --profile $(PROFILE) --locked -- -D warnings
	cargo clippy --manifest-path fuzz/Cargo.toml --all-targets --locked -- -D warnings
	ruff check python dev tests benches
	ruff format --check python dev tests benches
	$(PY) -m mypy
	$(PY) -m mypy.stubtest mmpack._native --allowlist .stubtest-allowlist

.PHONY: test
test: test-rust test-python lint  ## everything CI runs

# The demo is development code (dev/mmpack_dev, never in the wheel). The main job trains a tiny
# Qwen2-VL on packed and on padded batches of the same samples from the real Energon loader.
.PHONY: demo
demo: build  ## the main job
	PYTHONPATH=dev:tests$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m mmpack_dev demo

# The quick loader-only comparison, side by side with the test suite's plain-Python references
# (tests/reference), which the package never ships nor imports: they come in through --compare-with.
DEMO_COMPARE ?= reference.energon:ReferencePackingTaskEncoder
.PHONY: demo-toy
demo-toy: build-release  ## packing vs no packing on the loader alone, and the plain-Python reference
	PYTHONPATH=dev:tests$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m mmpack_dev demo --toy --compare-with $(DEMO_COMPARE)

.PHONY: bench
bench: build-release  ## every benchmark, side by side with the plain-Python references
	$(PY) -m pip install -q -c constraints.txt --group bench
	@for b in benches/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

.PHONY: wheel
wheel: venv  ## release wheel (fat LTO) into dist/, installed into a fresh venv and used there
	rm -rf dist && maturin build --release --locked --out dist
	$(PY) -c "$$WHEEL_CONTENTS" dist/mmpack-*.whl
	rm -rf $(VENV)-wheel && python3 -m venv $(VENV)-wheel
	$(VENV)-wheel/bin/pip install -q -c constraints.txt numpy
	$(VENV)-wheel/bin/pip install -q --no-deps dist/mmpack-*.whl
	cd / && $(abspath $(VENV))-wheel/bin/python -c "$$WHEEL_SMOKE"

# The wheel ships the product only: no test oracle, tests, benches, demo, synthetic data or test
# helpers; every Python file in it is one of the package's wings, integrations or shared modules.
define WHEEL_CONTENTS
import re, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
dev = re.compile(r"reference|demo|synthetic|testing|(^|/)tests?/|(^|/)test_|^benches/|^dev/|mmpack_dev")
bad = [n for n in names if dev.search(n) and ".dist-info/" not in n]
assert not bad, f"wheel contains development-only files: {bad}"
rooms = ("batch/", "compat/", "energon/", "packed/", "packing/", "safe_load/", "vision/")
py = [n.removeprefix("mmpack/") for n in names if n.startswith("mmpack/") and n.endswith(".py")]
stray = [n for n in py if "/" in n and not n.startswith(rooms)]
assert not stray, f"wheel has Python files outside the package's rooms: {stray}"
assert "mmpack/packed/value.py" in names and "mmpack/py.typed" in names, names
assert {"mmpack_startup.pth", "mmpack_startup.py"} <= set(names), "the MMPACK_INSTALL startup hook is missing"
print(f"wheel contents OK: {len(names)} files, product only")
endef
export WHEEL_CONTENTS

# Run from / so the source tree cannot shadow the installed wheel; torch is not installed there,
# which also proves that packing and masks need numpy alone.
define WHEEL_SMOKE
import mmpack, mmpack.batch.masks, mmpack.packing
assert "site-packages" in mmpack.__file__, mmpack.__file__
p = mmpack.packing.pack([3, 5, 2, 7], 10)
assert sorted(p.item_indices.tolist()) == [0, 1, 2, 3] and p.num_bins == 2
import os, subprocess, sys
probe = "import sys; print('mmpack_startup' in sys.modules and 'mmpack' not in sys.modules)"
for value, armed in (("1", "True"), ("0", "False")):
    env = dict(os.environ, MMPACK_INSTALL=value)
    got = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert got.stdout.strip() == armed, (value, got.stdout, got.stderr)
print("mmpack", mmpack.__version__, "wheel OK:", mmpack.__file__)
endef
export WHEEL_SMOKE

# --- fuzz ---
# cargo-fuzz needs nightly features; RUSTC_BOOTSTRAP=1 lets the stable toolchain build them.
# No sanitizer: the core forbids unsafe code, so ASan would only slow the search down; overflow
# checks and debug assertions stay on (cargo-fuzz's default). Not part of `make test`: the
# saved inputs replay in rust/core/tests/fuzz_regressions.rs.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= csr pack mask batch gather
.PHONY: fuzz
fuzz:  ## run each cargo-fuzz target for FUZZ_SECONDS seconds, one after the other
	@command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
	@mkdir -p fuzz/target
	@for t in $(FUZZ_TARGETS); do \
	  echo "== fuzz $$t ($(FUZZ_SECONDS)s)"; \
	  RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer none $$t -- \
	    -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 > fuzz/target/fuzz-$$t.log 2>&1; \
	  rc=$$?; grep -E '^(Done|stat::number_of_executed_units|stat::peak_rss_mb)' fuzz/target/fuzz-$$t.log; \
	  if [ $$rc -ne 0 ]; then tail -40 fuzz/target/fuzz-$$t.log; exit $$rc; fi; \
	done
# The restricted loader's differential fuzzer (tests/support/loader_fuzz.py): each payload in a
# child under a hard memory limit. `make test` runs a short fixed run
# (tests/safe_load/test_loader_fuzz.py); this runs for LOADER_FUZZ_SECONDS, niced.
LOADER_FUZZ_SECONDS ?= 600
LOADER_FUZZ_SEED ?= 1
.PHONY: fuzz-loader
fuzz-loader: build  ## fuzz mmpack.safe_load.loads for LOADER_FUZZ_SECONDS seconds
	PYTHONPATH=tests$${PYTHONPATH:+:$$PYTHONPATH} nice -n 10 $(PY) -m support.loader_fuzz \
	  --seconds $(LOADER_FUZZ_SECONDS) --seed $(LOADER_FUZZ_SEED)
# --- end fuzz ---

.PHONY: fmt
fmt: venv
	cargo fmt --all
	ruff format python dev tests benches
	ruff check --fix python dev tests benches

.PHONY: clean
clean:
	rm -rf target dist $(VENV)-wheel
