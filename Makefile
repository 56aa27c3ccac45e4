# `make demo` and `make test` work from a fresh clone: each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gputq-installed

.PHONY: demo test test-busy test-throttled test-slow test-base bench install-check clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first and pinned: the CPU wheel of exactly this version is what dev machines carry;
	# anything that pulls torch later must find it satisfied instead of fetching a CUDA build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev,rdma,metrics]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gputq demo

test: $(STAMP)
	$(PY) -m pytest -m "not slow"

# The fast suite beside two CPU-bound processes, as on a busy CI machine: no fast test may depend on
# timing or free cores.
test-busy: $(STAMP)
	$(PY) scripts/busy.py -n 2 -- $(PY) -m pytest -m "not slow"

# The fast suite on half a core's worth of CPU time, as in a CI container with a CPU limit (a cgroup's CFS
# quota: needs root).
test-throttled: $(STAMP)
	$(PY) scripts/busy.py -n 0 --cpus 0.5 -- $(PY) -m pytest -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# The fast suite in a fresh venv holding only gputq's own requirements and the test tools, on any Python it
# supports (`make test-base PYTHON=python3.10`): what needs torch, Ray, NIXL or a GPU must skip, not fail.
test-base:
	rm -rf .venv-base
	$(PYTHON) -m venv .venv-base
	# A pip that installs editable through setuptools' hook (PEP 660): an older one's setup.py develop
	# would not map gputq.transport and gputq.kernels onto their folders.
	.venv-base/bin/python -m pip install -q --upgrade pip
	.venv-base/bin/python -m pip install -q -e . "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6"
	.venv-base/bin/python -m pytest -m "not slow"

# A fresh venv with only `pip install 'gputq[rdma,ray]'`: rdma must work with no extra step.
install-check:
	$(PYTHON) scripts/install_check.py

# The peer systems and the figures' libraries come with the bench extra.
bench: $(STAMP)
	$(PY) -m pip install -e ".[bench]"
	$(PY) -m bench.memory
	$(PY) -m bench.peers
	$(PY) -m bench.fetch
	$(PY) -m bench.fetch --transport shm
	$(PY) -m bench.transport
	$(PY) -m bench.put
	$(PY) -m bench.release
	$(VENV)/bin/gputq capacity --reference

clean:
	rm -rf $(VENV) .venv-base build *.egg-info
