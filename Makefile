PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE := $(VENV)/.installed
TEST := $(VENV)/.installed-test

.PHONY: demo test install clean

$(BASE): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch==2.13.0 first: on the CPU machines it is the CPU build that lies on disk
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $(BASE)

$(TEST): $(BASE)
	$(BIN)/pip install -q -e '.[test]'
	touch $(TEST)

install: $(BASE)

demo: $(BASE)
	rm -rf runs/demo
	$(BIN)/onepath train --config onepath/configs/demo.yaml --mode both --out runs/demo

test: $(TEST)
	$(BIN)/pytest -q -m "not gpu"

clean:
	rm -rf $(VENV) runs
