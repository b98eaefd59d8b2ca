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

.PHONY: demo test bench venv clean

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

bench: $(STAMP)
	$(PY) scripts/bench.py $(ARGS)

clean:
	rm -rf $(VENV) outputs
