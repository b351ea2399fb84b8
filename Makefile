PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch==2.13.0 first: on the CPU machines it is the CPU build that lies on disk
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/onepath train --config onepath/configs/demo.yaml --mode both --out runs/demo

test: $(STAMP)
	$(BIN)/pytest -q -m "not gpu"

clean:
	rm -rf $(VENV) runs
