PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE := $(VENV)/.installed
TEST := $(VENV)/.installed-test

# the tests that guard the contract, for the edit loop (no interpreted kernels, SASS checks, multi-process runs or
# benches); CI runs `make test`, all of them
FAST := -m "not gpu and not slow" --ignore-glob='*_interpret.py' --ignore=tests/ops/test_attention_sass.py \
	--ignore=tests/train/test_distributed.py --ignore=tests/bench

.PHONY: demo test test-fast install clean

$(BASE): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch==2.13.0 first: on the CPU machines it is the CPU build that lies on disk
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $(BASE)

$(TEST): $(BASE)
	$(BIN)/pip install -q -e '.[test,ray]'
	touch $(TEST)

install: $(BASE)

demo: $(BASE)
	rm -rf runs/demo
	$(BIN)/onepath train --config onepath/configs/demo.yaml --mode both --out runs/demo

test: $(TEST)
	$(BIN)/pytest -q -m "not gpu" --durations=15

test-fast: $(TEST)
	$(BIN)/pytest -q $(FAST) --durations=10

clean:
	rm -rf $(VENV) runs
