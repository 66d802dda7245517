# `make demo` and `make test` are the README's first two commands: each sets up .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# glibc hands large blocks back to the OS on free by default, so every Inception batch re-faults its activations:
# with these settings Inception runs 1.5x faster on the CPU (up to 2x on benchmarks: first-touch page faults).
CPU_ALLOCATOR := MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000

.PHONY: demo test triton-versions bench bench-gpu bench-gpu-extended quality clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(CPU_ALLOCATOR) $(PY) demo.py --out results/demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q tests

# The Triton versions the supported torch versions pin (3.5.1, 3.6.0), each into its own folder under
# VCA_TRITON_VERSIONS (~/.cache/dit-vca/triton), never into the venv: the compile matrix compiles with them
# (bench/triton_compile.py; its tests skip a version that is missing). CI runs this before `make test`.
triton-versions: $(STAMP)
	$(PY) -m bench.triton_compile --install

bench: $(STAMP)
	$(CPU_ALLOCATOR) $(PY) -m bench.attention
	$(CPU_ALLOCATOR) $(PY) -m bench.samplers
	$(CPU_ALLOCATOR) $(PY) -m bench.train
	$(CPU_ALLOCATOR) $(PY) -m bench.fid

# The GPU runbooks run with the machine's own interpreter and packages, never the package index
# (docs/benchmarks.md: GPU runbooks).
bench-gpu:
	python3 -m bench.gpu

bench-gpu-extended:
	python3 -m bench.gpu_extended

quality: $(STAMP)
	$(CPU_ALLOCATOR) $(PY) -m studies.quality --stage all

clean:
	rm -rf $(VENV) results
