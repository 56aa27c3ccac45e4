# `make demo` and `make test` work from a fresh clone: each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gputq-installed

.PHONY: demo test bench clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first and pinned: the CPU wheel of exactly this version is what dev machines carry;
	# anything that pulls torch later must find it satisfied instead of fetching a CUDA build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev,rdma]"
	# nixl-cu12 provides the bindings; this adds the `nixl` import name without its CUDA torch pin.
	$(PY) -m pip install --no-deps nixl==1.5.1
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gputq demo

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -m bench.fetch
	$(PY) -m bench.transport

clean:
	rm -rf $(VENV) build *.egg-info
