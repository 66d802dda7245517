# `make demo` and `make test` are the README's first two commands: each sets up .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) demo.py --out results/demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 $(PY) bench/attention.py
	MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 $(PY) bench/samplers.py
	MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 $(PY) bench/train.py
	MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 $(PY) bench/fid.py

clean:
	rm -rf $(VENV) results
