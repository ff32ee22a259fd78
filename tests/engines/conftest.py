"""Engine adapter tests: run against the real vLLM / SGLang packages in .venv-engines
(``make test-engines``); ``make test`` leaves this folder out (tests/conftest.py).

The Redis fixtures (``redis_server``, ``redis_url``) come from tests/conftest.py: a real
valkey/redis server started by PID on a private socket."""

import os
import sys

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, os.path.dirname(__file__))  # engine_helpers
import engine_helpers  # noqa: E402,F401  (the torchvision placeholder, see there)


@pytest.fixture(params=["lmdb", "redis"])
def where(request, tmp_path):
    """An L3 location of each backend: an LMDB directory, or a fresh real Redis server's URL."""
    if request.param == "lmdb":
        return str(tmp_path / "l3")
    return request.getfixturevalue("redis_url")
