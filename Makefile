# Two commands a new user needs: `make demo` and `make test`. Both set up what is missing first.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# gpu when an NVIDIA driver answers, else cpu; override with `make setup PROFILE=cpu|gpu`
PROFILE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
REQS := requirements/$(PROFILE).txt requirements/sglang.txt pyproject.toml
STAMP := $(VENV)/.rollverify-$(PROFILE)-$(shell cat $(REQS) 2>/dev/null | sha256sum | cut -c1-16)
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast test-slow chaos lint check-gpu-resolve clean-venv te gpu-smoke-bundle

setup: $(STAMP)

$(STAMP):
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; RollVerify needs Python 3.11" >&2; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[setup] installing the $(PROFILE) path into $(VENV) (first run: a few minutes)"
	@if [ "$(PROFILE)" = cpu ]; then \
	  $(PY) -m pip install -q --disable-pip-version-check -r requirements/cpu.txt && \
	  $(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements/sglang.txt ; \
	else \
	  $(PY) -m pip install -q --disable-pip-version-check -r requirements/gpu.txt ; \
	fi
	@$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@rm -f $(VENV)/.rollverify-*
	@touch $(STAMP)
	@echo "[setup] done: $$(du -sh $(VENV) | cut -f1) in $(VENV)"

demo: setup
	$(VENV)/bin/rollverify demo

# Tiers (markers in pyproject.toml; tests/conftest.py says what each holds):
# every test except those marked slow (over ~90 s each here); its 30 slowest go to docs/test-durations.txt
test: setup
	$(PY) -m pytest -q -m "not slow" --durations-file=docs/test-durations.txt $(PYTEST_ARGS)

# the pure-logic tests (no SGLang, no Megatron-Core, no other real processes): a maintainer's inner loop
test-fast: setup
	ROLLVERIFY_TEST_TIER=fast $(PY) -m pytest -q -m "not engine and not megatron and not system and not slow" $(PYTEST_ARGS)

# the slow tests but the chaos run
test-slow: setup
	$(PY) -m pytest -q -m "slow and not chaos" --durations-file=docs/test-durations-slow.txt $(PYTEST_ARGS)

# the 60-step chaos run (about an hour here): servers, trainer ranks, the driver and the checkpoint disk fail
chaos: setup
	$(PY) -m pytest -q -m chaos $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check rollverify sglang_ext megatron_bridge tools tests

# pip's resolver on requirements/gpu.txt (dry run, own venv, no install): does the GPU path install? ~3-6 min
check-gpu-resolve:
	$(PYTHON) tools/check_gpu_resolve.py

clean-venv:
	rm -rf $(VENV)

# Transformer Engine (requirements/te.txt, inside megatron-core 0.16.1's range): its PyTorch extension builds from
# source against this venv's torch; a GPU node with the CUDA toolkit (nvcc) and cuDNN, after `make setup PROFILE=gpu`
te: setup
	$(PY) -m pip install --no-build-isolation -r requirements/te.txt
	$(PY) -c "import transformer_engine.pytorch as te; print('[te] Transformer Engine', te.__version__)"

# everything tools/gpu_smoke.py needs on a bare GPU machine (python 3.12, torch, transformers; no network) in one
# folder of at most 60 MiB: the megatron-core source, the planner's figures, the tiny models (tools/gpu_smoke_bundle.py)
gpu-smoke-bundle: setup
	$(PY) tools/gpu_smoke_bundle.py --out build/gpu-smoke
