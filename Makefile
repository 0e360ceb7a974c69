# The two commands: `make run` and `make test` (see README.md). Both create .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check

.PHONY: run test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch goes in first. Without CUDA, pin the CPU build so that nothing later resolves
# "torch" to a multi-GB CUDA build; with CUDA, keep (or fetch) the user's own build.
$(VENV)/.torch: | $(PY)
	if command -v nvidia-smi >/dev/null 2>&1; then \
	    $(PY) -c "import torch" 2>/dev/null || $(PIP) install torch; \
	else \
	    $(PIP) install torch==2.13.0; \
	fi
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PIP) install -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(PIP) install -e '.[test]'
	touch $@ $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/hicache serve

test: $(VENV)/.installed-test
	$(PY) -m pytest

bench: $(VENV)/.installed
	$(PIP) install -e '.[bench]'
	$(PY) benchmarks/bench_tree.py --page-size 16

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
