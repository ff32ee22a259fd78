"""Engine adapter tests: run against the real vLLM / SGLang packages in .venv-engines
(``make test-engines``); ``make test`` leaves this folder out (tests/conftest.py).

The Redis fixtures (``redis_server``, ``redis_url``) come from tests/conftest.py: a real
valkey/redis server started by PID on a private socket. Every test runs with a fleet secret in
``$HICACHE_L3_SECRET_FILE`` (as a fleet does: a shared store is refused without one); the tests of
that rule take it away."""

import os
import sys

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, os.path.dirname(__file__))  # engine_helpers
import engine_helpers  # noqa: E402,F401  (the torchvision placeholder, see there)


@pytest.fixture(autouse=True)
def fleet_secret(tmp_path_factory, monkeypatch):
    """The fleet secret every adapter in these tests (and the processes they spawn) reads."""
    from helpers import secret_file
    from hicache.l3 import auth
    path = secret_file(tmp_path_factory.mktemp("secret"))
    monkeypatch.setenv(auth.ENV, path)
    return path


@pytest.fixture(params=["lmdb", "redis"])
def where(request, tmp_path):
    """An L3 location of each backend: an LMDB directory, or a fresh real Redis server's URL."""
    if request.param == "lmdb":
        return str(tmp_path / "l3")
    return request.getfixturevalue("redis_url")
