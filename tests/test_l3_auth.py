"""Authenticated L3, tested as attacks: a writer with the store's address (or directory) but
not the fleet secret overwrites values with other KV and a checksum it recomputed, and plants
values under the keys it computes from a prompt. hicache serves none of them (each a counted
miss) and replaces them. Plus: the secret file's rules, the refusal of a shared store without
a secret, rotation, ``hicache l3 check`` with the secret, the metric."""

import os
import subprocess
import sys

import pytest
import torch

from hicache.config import loads
from hicache.errors import ConfigError
from hicache.l3 import Namespace, open_store, page_keys, registry
from hicache.l3 import auth
from hicache.l3.base import checksum, header_prefix
from hicache.l3.keyed import KeyedStore

from helpers import secret_file

NS = Namespace("m", num_layers=2, kv_dim=8, dtype="bfloat16", page_size=4, dcp_size=2)
PT = NS.page_tokens
PROMPT = list(range(100, 100 + 4 * PT))


def shard(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NS.shard_shape, generator=g).to(NS.torch_dtype)


def empty(n: int) -> list:
    return [torch.full(NS.shard_shape, 7.0, dtype=NS.torch_dtype) for _ in range(n)]


def forged(key: bytes, payload: torch.Tensor) -> bytes:
    """What an attacker without the secret writes: the unauthenticated value format with a
    checksum it computed itself over other KV."""
    data = payload.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    return header_prefix(NS, 0) + checksum(key, data) + data


@pytest.fixture(params=["lmdb", "redis", "mem"])
def authed(request, tmp_path):
    """(fixture, our authenticated store, the raw backend store an attacker reaches)."""
    import l3_mem_backend
    registry.register(l3_mem_backend.BACKEND, replace=True)
    request.addfinalizer(lambda: registry.unregister("mem"))
    b = registry.get(request.param)
    secrets = auth.load(None, env={auth.ENV: secret_file(tmp_path)})
    with b.fixture(str(tmp_path)) as fx:
        section = b.section(**fx.keys)
        ours = open_store(section_where(b, section), NS, 0, secrets=secrets)
        raw = b.open(section, NS, 0)  # the same store, no secret
        request.node.where = section_where(b, section)
        yield fx, ours, raw
        ours.close()
        raw.close()


def section_where(b, section):
    return section.path if b.name == "lmdb" else (section.url if b.name == "redis" else
                                                  f"mem:{section.name}")


def test_overwritten_values_with_recomputed_checksums_are_misses_and_replaced(authed):
    fx, ours, raw = authed
    assert isinstance(ours, KeyedStore)
    keys = page_keys(PROMPT, PT, NS, 0)
    assert ours.put(keys, [shard(i) for i in range(4)]).written == 4
    # the attacker finds the stored keys (it can list the server) and rewrites each value
    stored = KeyedStore.store_keys(keys, ours.secrets.current)
    for i, k in enumerate(stored):
        fx.raw_put(ours.inner, k, forged(k, shard(100 + i)))
    out = empty(4)
    assert ours.get(keys, out) == 0  # nothing forged is served
    assert torch.equal(out[0], empty(1)[0])
    st = ours.stats
    assert st.auth_failures == 1 and st.misses == 1 and st.hits == 0
    # the reader removed the bad value: the next writer replaces it, and it is served again
    assert ours.put(keys[:1], [shard(0)]).written == 1
    assert ours.get(keys[:1], out) == 1 and torch.equal(out[0], shard(0))
    # a forged value with our header layout but a made-up tag fails the same way
    k1 = stored[1]
    fake = ours.inner._head_prefix + bytes(16) + shard(9).view(torch.uint8).reshape(-1) \
        .numpy().tobytes()
    fx.raw_put(ours.inner, k1, fake)
    assert ours.get(keys, empty(4)) == 1 and ours.stats.auth_failures == 2


def test_values_planted_under_keys_computed_from_a_prompt_are_never_found(authed):
    fx, ours, raw = authed
    keys = page_keys(PROMPT, PT, NS, 0)  # what anyone can compute from the tokens
    raw.put(keys, [shard(50 + i) for i in range(4)])  # planted first, well-formed
    assert raw.exists_prefix(keys) == 4
    assert ours.exists_prefix(keys) == 0 and ours.get(keys, empty(4)) == 0
    # hicache stores the prompt under keys only the secret gives; the planted ones never hit
    assert ours.put(keys, [shard(i) for i in range(4)]).written == 4
    out = empty(4)
    assert ours.get(keys, out) == 4
    assert all(torch.equal(out[i], shard(i)) for i in range(4))
    # the same planted value moved under our store key: fails its MAC
    stored = KeyedStore.store_keys(keys, ours.secrets.current)
    fx.raw_put(ours.inner, stored[0], forged(stored[0], shard(50)))
    assert ours.get(keys, empty(4)) == 0 and ours.stats.auth_failures == 1


def test_rotation_reads_either_secret_and_writes_the_current_one(tmp_path):
    old, new = secret_file(tmp_path, "old"), secret_file(tmp_path, "new")
    path = str(tmp_path / "s")
    keys = page_keys(PROMPT, PT, NS, 0)
    with open_store(path, NS, 0, secrets=auth.load(None, env={auth.ENV: old})) as s:
        s.put(keys[:2], [shard(0), shard(1)])
    both = auth.load(None, env={auth.ENV: new, auth.ENV_PREVIOUS: old})
    with open_store(path, NS, 0, secrets=both) as s:
        s.put(keys[2:], [shard(2), shard(3)])
    with open_store(path, NS, 0, secrets=auth.load(None, env={auth.ENV: new})) as s:
        assert s.exists_prefix(keys) == 0  # the old secret's pages are not the new one's
        assert s.exists_prefix(keys[2:]) == 2  # what the rotation wrote stays
    with open_store(path, NS, 0, secrets=auth.load(None, env={auth.ENV: old})) as s:
        assert s.exists_prefix(keys[2:]) == 0  # and the old secret alone cannot find it
    with open_store(path, NS, 0, secrets=both) as s:
        out = empty(2)
        assert s.exists_prefix(keys) == 2 and s.get(keys[:2], out) == 2
        assert torch.equal(out[1], shard(1))
    # a hit on an old page rewrote it under the current secret: the new secret alone finds it
    with open_store(path, NS, 0, secrets=auth.load(None, env={auth.ENV: new})) as s:
        out = empty(4)
        assert s.exists_prefix(keys) == 4 and s.get(keys, out) == 4
        assert all(torch.equal(out[i], shard(i)) for i in range(4))


def test_a_leaked_previous_secret_cannot_sign_pages_under_the_current_secrets_keys(authed,
                                                                                     tmp_path,
                                                                                     request):
    """The attacker holds the previous (leaked) secret and lists the server's keys: it re-signs
    the values stored under the current secret's keys with other KV. None is served; values
    under the previous secret's own keys still are (the rotation window)."""
    fx, ours, raw = authed
    leaked = auth.read_secret(secret_file(tmp_path, "leaked"), "test")
    rotated = open_store(request.node.where, NS, 0,
                         secrets=auth.Secrets(ours.secrets.current, leaked))
    request.addfinalizer(rotated.close)
    keys = page_keys(PROMPT, PT, NS, 0)
    assert rotated.put(keys, [shard(i) for i in range(4)]).written == 4
    head = ours.inner._head_prefix
    for i, k in enumerate(KeyedStore.store_keys(keys, rotated.secrets.current)):
        other = shard(200 + i).view(torch.uint8).reshape(-1).numpy().tobytes()
        fx.raw_put(ours.inner, k, head + leaked.tag(k, head, other) + other)
    assert rotated.get(keys, empty(4)) == 0 and rotated.stats.auth_failures == 1
    # the previous secret still vouches for the pages under its own keys, and a hit moves
    # each of them under the current secret
    keys2 = page_keys(PROMPT[::-1], PT, NS, 0)
    with open_store(request.node.where, NS, 0, secrets=auth.Secrets(leaked)) as before:
        assert before.put(keys2, [shard(i) for i in range(4)]).written == 4
    out = empty(4)
    assert rotated.get(keys2, out) == 4 and torch.equal(out[3], shard(3))
    assert ours.exists_prefix(keys2) == 4 and ours.get(keys2, empty(4)) == 4


def test_the_secret_file_must_be_private_regular_and_long_enough(tmp_path):
    good = secret_file(tmp_path)
    assert auth.load(None, env={auth.ENV: good}).current.fingerprint
    shared = tmp_path / "shared.secret"
    shared.write_text("x" * 32)
    os.chmod(shared, 0o644)
    short = tmp_path / "short.secret"
    short.write_text("tiny")
    os.chmod(short, 0o600)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, words in [(shared, "readable or writable by others .*chmod 600"),
                        (short, "a secret needs at least 16"), (fifo, "not a regular file"),
                        (tmp_path / "none", "cannot open")]:
        with pytest.raises(ConfigError, match=words) as e:
            auth.load(None, env={auth.ENV: str(path)})
        assert "\n" not in str(e.value) and "HICACHE_L3_SECRET_FILE" in str(e.value)
    with pytest.raises(ConfigError, match="l3.secret_file: .*readable or writable by others"):
        auth.load(loads(f'[l3]\nsecret_file = "{shared}"\n').l3, env={})
    with pytest.raises(ConfigError, match="previous_secret_file: given without"):
        auth.load(None, env={auth.ENV_PREVIOUS: good})
    assert repr(auth.load(None, env={auth.ENV: good})).count("key") == 0  # no key bytes shown


def test_a_shared_store_without_a_secret_is_refused_unless_said_so(tmp_path, monkeypatch):
    from hicache.preflight import Machine, validate
    monkeypatch.delenv(auth.ENV, raising=False)
    m = Machine(cuda=False, host_available=64 << 30)
    text = '[l3]\nenabled = true\nbackend = "redis"\n[l3.redis]\nurl = "redis://127.0.0.1:1/0"\n'
    with pytest.raises(ConfigError, match="l3.secret_file: the redis backend is shared") as e:
        validate(loads(text), machine=m)
    assert "\n" not in str(e.value) and "authenticate = false" in str(e.value)
    with pytest.raises(ConfigError, match="needs a fleet secret"):
        open_store(loads(text).l3, NS, 0)
    assert validate(loads(text.replace("enabled = true", "enabled = true\nauthenticate = false")),
                    machine=m) == []
    validate(loads(text.replace("enabled = true", f'enabled = true\nsecret_file = '
                                f'"{secret_file(tmp_path)}"')), machine=m)
    monkeypatch.setenv(auth.ENV, secret_file(tmp_path))
    assert validate(loads(text), machine=m) == []
    lm = loads(f'[l3]\nenabled = true\n[l3.lmdb]\npath = "{tmp_path}/l"\n')
    monkeypatch.delenv(auth.ENV)
    assert validate(lm, machine=m) == []  # LMDB may run without one


def test_every_way_into_a_shared_store_takes_the_same_rule(tmp_path, monkeypatch, redis_url,
                                                           caplog):
    """open_store on a bare URL (what the engine adapters call, with their extra config as
    ``trust``) refuses a shared store without the secret with the policy's one line, runs it
    with the explicit ``authenticate = false`` and says so in one warning line."""
    import logging
    monkeypatch.delenv(auth.ENV, raising=False)
    monkeypatch.setattr(auth, "_WARNED", set())
    for kw in ({}, {"trust": auth.Trust()}, {"secrets": None}):
        with pytest.raises(ConfigError, match="secret_file: the redis backend is shared") as e:
            open_store(redis_url, NS, 0, **kw)
        assert "\n" not in str(e.value) and "set authenticate = false" in str(e.value)
    with pytest.raises(ConfigError, match="needs a fleet secret"):
        open_store(["redis://127.0.0.1:1", "redis://127.0.0.1:2"], NS, 0)  # a cluster
    with caplog.at_level(logging.WARNING, logger="hicache"):
        for _ in range(2):  # one line per process, however many stores open
            open_store(redis_url, NS, 0, trust=auth.Trust(authenticate=False)).close()
    lines = [r.getMessage() for r in caplog.records if "without a fleet secret" in r.getMessage()]
    assert len(lines) == 1 and "authenticate = false" in lines[0]
    sec = secret_file(tmp_path)
    with open_store(redis_url, NS, 0, trust=auth.Trust(secret_file=sec)) as s:
        assert isinstance(s, KeyedStore) and s.secrets == auth.load(None, env={auth.ENV: sec})
    monkeypatch.setenv(auth.ENV, sec)
    with open_store(redis_url, NS, 0) as s:
        assert isinstance(s, KeyedStore)
    with pytest.raises(ConfigError, match="authenticate: must be true or false"):
        auth.Trust.of({"authenticate": "no"})
    with pytest.raises(ConfigError, match="secret_file: must be a path"):
        auth.Trust.of({"secret_file": 3})
    monkeypatch.delenv(auth.ENV)
    with open_store(str(tmp_path / "l"), NS, 0) as s:  # LMDB may run without one
        assert not isinstance(s, KeyedStore)


def test_the_service_counts_auth_failures_in_stats_and_metrics(tmp_path):
    import re

    from prometheus_client import generate_latest

    from hicache.l3 import chain_hashes
    from hicache.l3.lmdb_backend import _raw_put
    from hicache.metrics import HiCacheMetrics
    from hicache.service import HiCache
    from hicache.engine.model import MLAModel
    from hicache.serving import Server, model_config
    from hicache.workloads import Request
    from helpers import make_cfg, l3_writes_land_at_once
    cfg = make_cfg(tmp_path / "l3", l3={"secret_file": secret_file(tmp_path)})
    prompt = torch.arange(40).numpy() % 128
    torch.manual_seed(0)
    with l3_writes_land_at_once(), HiCache(cfg, mode="l1+l2+l3") as cache:
        Server(MLAModel(model_config(cfg)), cache, chunk_tokens=16).run(
            [Request(0, 0, prompt, 2, 0)])
    with HiCache(cfg, mode="l1+l2+l3") as cache:
        keys = cache.io.keys(chain_hashes(prompt, cache.page_tokens))
        store = cache.l3._store  # the KeyedStore behind the service's guard
        assert isinstance(store, KeyedStore) and store.exists_prefix(keys) == len(keys)
        k0 = KeyedStore.store_keys(keys, store.secrets.current)[0]
        inner = store.inner  # the attacker rewrites the first page in the directory
        _raw_put(inner, k0, inner._head_prefix + bytes(16) + bytes(inner.page_bytes))
        dst = [torch.empty(inner.namespace.shard_shape, dtype=inner.namespace.torch_dtype)]
        assert cache.l3.get(keys[:1], dst) == 0
        assert cache.stats()["l3_auth_failures"] == 1
        text = generate_latest(HiCacheMetrics(cache).registry).decode()
        assert re.search(r'hicache_l3_failures_total\{[^}]*reason="auth"[^}]*\} 1\.0', text), text
        assert re.search(r'hicache_l3_failures_total\{[^}]*reason="corrupt"[^}]*\} 0\.0', text)


def test_l3_check_verifies_macs_with_the_secret(tmp_path):
    sec, other = secret_file(tmp_path, "a"), secret_file(tmp_path, "b")
    path = str(tmp_path / "s")
    keys = page_keys(PROMPT, PT, NS, 0)
    with open_store(path, NS, 0, secrets=auth.load(None, env={auth.ENV: sec})) as s:
        s.put(keys, [shard(i) for i in range(4)])

    def check(*extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_L3_")}
        r = subprocess.run([sys.executable, "-m", "hicache.commands.cli", "l3", "check", path,
                            *extra],
                           capture_output=True, text=True, timeout=120, env=env)
        return r.returncode, r.stdout.strip() + r.stderr.strip()

    rc, out = check()
    assert rc == 0 and "4 authenticated values not verified" in out
    rc, out = check("--secret-file", sec)
    assert rc == 0 and "MACs verified" in out
    for extra in ((), ("--quarantine",)):  # every MAC fails: a wrong secret, not damage
        rc, out = check("--secret-file", other, *extra)
        assert rc == 2 and "every MAC fails (4 of 4" in out and "secret is likely wrong" in out
        assert os.path.isdir(path) and "\n" not in out  # never moved aside
    # one value really damaged under the right secret: damage (quarantine allowed)
    from hicache.l3.lmdb_backend import _tamper
    with open_store(path, NS, 0, secrets=auth.load(None, env={auth.ENV: sec})) as s:
        _tamper(s.inner, KeyedStore.store_keys(keys[:1], s.secrets.current)[0])
    rc, out = check("--secret-file", sec)
    assert rc == 1 and "1 of 4 values fail their checksum or MAC" in out
    with open_store(path, NS, 0, secrets=auth.load(None, env={auth.ENV: sec})) as s:
        s.delete(keys[:1])
        s.put(keys[:1], [shard(0)])
    rc, out = check("--secret-file", other, "--previous-secret-file", sec)
    assert rc == 0 and "MACs verified" in out
    os.chmod(other, 0o640)
    rc, out = check("--secret-file", other)
    assert rc == 2 and "readable or writable by others" in out and "\n" not in out
