"""Operator tools on real stores: ``hicache l3 ls`` lists the namespaces real service runs wrote
(LMDB directory; Redis with a fleet secret, listed without it), ``hicache l3 purge`` deletes
exactly one (the other is still served), bad input is one line and exit 2; the registry's
purge of one rank (SGLang's ``clear()``); ``localserver --cluster 3 --port P``."""

import json
import os
import random
import socket
import subprocess
import sys
import warnings

import numpy as np
import pytest
import redis
import torch

from hicache.l3.auth import Trust
from hicache.commands import cli
from hicache.l3 import Namespace, open_store, page_keys, registry
from hicache.l3.localserver import port_free

from helpers import l3_writes_land_at_once, make_cfg, secret_file
from test_service import revisit_trace, serve

NS = Namespace("admin-test", num_layers=2, kv_dim=8, dtype="float32", page_size=4, dcp_size=2)


def _cfg(kind, tmp_path, url, signature):
    cfg = make_cfg(tmp_path / "l3", l1_pages=16, l2_ratio=1.0, prefetch="wait_complete",
                   signature=signature)
    if kind == "redis":  # authenticated: `ls` and `purge` need no secret
        cfg = cfg.replace(l3={"backend": "redis", "url": url, "path": "unused",
                              "secret_file": secret_file(tmp_path)})
    return cfg


def _held(kind, where):
    """Pages held (not records), and bytes, read past hicache's tools."""
    if kind == "lmdb":
        from hicache.l3.store import PageStore
        with PageStore(where, NS, 0, capacity_bytes=1 << 20, writer=False) as s:
            return s.num_pages(), s.used_bytes()
    with redis.Redis.from_url(where) as c:
        keys = [k for k in c.scan_iter(match=b"hicache:*") if not k.startswith(b"hicache:ns:")]
        return len(keys), sum(c.strlen(k) for k in keys)


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("kind", ["lmdb", "redis"])
def test_ls_shows_what_service_runs_wrote_and_purge_deletes_exactly_one(kind, tmp_path,
                                                                       redis_url, capsys):
    where = str(tmp_path / "l3") if kind == "lmdb" else redis_url
    store = [where] if kind == "lmdb" else ["--url", where]
    jobs = revisit_trace(sessions=3, seed=8)
    cfgs = {sig: _cfg(kind, tmp_path, redis_url, sig) for sig in ("weights-a", "weights-b")}
    with l3_writes_land_at_once():
        for cfg in cfgs.values():  # two models' runs write to one store
            serve(cfg, "l1+l2+l3", jobs)
    rc, out, err = run_cli(capsys, "l3", "ls", *store, "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert len(rows) == 2
    by_sig = {sig: next(r for r in rows if r["model"].startswith(sig + ":")) for sig in cfgs}
    pages, nbytes = _held(kind, where)
    assert sum(r["keys"] for r in rows) == pages > 0  # every page, in one namespace or another
    assert sum(r["bytes"] for r in rows) == nbytes
    for r in rows:
        assert r["keys"] > 0 and r["ranks"] == [0] and len(r["namespace"]) == 32
        assert "kv:striped" in r["layout"] and "P=4" in r["layout"] and "dcp=1" in r["layout"]
    rc, out, _ = run_cli(capsys, "l3", "ls", *store)  # the table
    assert rc == 0 and all(r["namespace"] in out and r["model"] in out for r in rows)

    gone, kept = by_sig["weights-a"], by_sig["weights-b"]
    rc, out, err = run_cli(capsys, "l3", "purge", *store, "--namespace", gone["namespace"][:8])
    assert rc == 0, err
    assert out.strip() == (f"deleted namespace {gone['namespace']} ({gone['model']}, "
                           f"{gone['layout']}): {gone['keys']} keys, {gone['bytes']} bytes freed")
    rc, out, _ = run_cli(capsys, "l3", "ls", *store, "--json")
    assert json.loads(out) == [kept]  # the other namespace is untouched
    assert _held(kind, where) == (kept["keys"], kept["bytes"])
    # bad input: one line, exit 2, nothing deleted
    for argv, says in (
            (["purge", *store, "--namespace", "ffffffffffff"], "no namespace ffffffffffff"),
            (["purge", *store, "--namespace", "zz"], "32 hex digits"),
            (["ls"], "give a store"),
            (["ls", str(tmp_path / "nothing-here")], "holds no LMDB store"),
            (["ls", "--url", "http://127.0.0.1:1/0"], "not a URL"),
            (["purge", "--url", "redis://127.0.0.1:1/0", "--namespace", "ffffffff"],
             "cannot reach the L3 store redis://127.0.0.1:1/0: refused")):
        rc, out, err = run_cli(capsys, "l3", *argv)
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, (argv, err)
        assert says in err, (argv, err)
    assert _held(kind, where)[0] == kept["keys"]
    # served again from a cold L1/L2: the kept model's pages hit L3, the purged model's do not
    with l3_writes_land_at_once():
        _, st_kept = serve(cfgs["weights-b"], "l1+l2+l3", jobs[:3])
        _, st_gone = serve(cfgs["weights-a"], "l1+l2+l3", jobs[:3])
    assert st_kept["hit_tokens"]["l3"] > 0 and st_gone["hit_tokens"]["l3"] == 0


def _three_pages(where, rank):
    with open_store(where, NS, rank, secrets=None, trust=Trust(authenticate=False)) as s:
        keys = page_keys(list(range(3 * NS.page_tokens)), NS.page_tokens, NS, rank)
        assert s.put(keys, [torch.full(NS.shard_shape, float(i)) for i in range(3)]).written == 3
        return keys


@pytest.mark.parametrize("kind", ["lmdb", "redis", "cluster"])
def test_purge_of_one_rank_keeps_the_others_and_the_record(kind, tmp_path, redis_url,
                                                           redis_cluster):
    """What SGLang's ``clear()`` calls: ``registry.purge(where, namespace, rank=r)``."""
    where = {"lmdb": str(tmp_path / "l3"), "redis": redis_url,
             "cluster": list(redis_cluster.urls)}[kind]
    if kind == "cluster":
        with redis.RedisCluster.from_url(redis_cluster.urls[0]) as c:
            c.flushall(target_nodes="primaries")
    keys = {r: _three_pages(where, r) for r in (0, 1)}
    (info,) = registry.namespaces(where)
    assert (info.digest, info.keys, info.ranks, info.namespace) == (NS.digest.hex(), 6, (0, 1),
                                                                    NS)
    gone = registry.purge(where, NS, rank=0)
    assert (gone.keys, gone.ranks) == (3, (0,)) and gone.bytes == info.bytes // 2
    (after,) = registry.namespaces(where)
    assert (after.keys, after.ranks, after.namespace) == (3, (1,), NS)  # record kept
    with open_store(where, NS, 1, secrets=None, trust=Trust(authenticate=False)) as s:
        assert s.exists_prefix(keys[1]) == 3
    with open_store(where, NS, 0, secrets=None, trust=Trust(authenticate=False)) as s:
        assert s.exists_prefix(keys[0]) == 0
    whole = registry.purge(where, NS.digest.hex())  # the whole namespace
    assert (whole.keys, whole.ranks, whole.namespace) == (3, (1,), NS)
    assert registry.namespaces(where) == []  # its record too


def test_a_forged_record_is_not_believed(tmp_path):
    where = str(tmp_path / "l3")
    _three_pages(where, 0)
    from hicache.l3.store import PageStore
    other = Namespace("forged", num_layers=2, kv_dim=8, dtype="float32", page_size=4,
                      dcp_size=2)
    with PageStore(where, NS, 0, capacity_bytes=1 << 20) as s:
        with s._env.begin(write=True) as txn:  # an outsider's record under NS's digest
            txn.put(b"ns:" + NS.digest, other.record(), db=s._meta)
    (info,) = registry.namespaces(where)
    assert info.keys == 3 and info.namespace is None and info.model == "?"


# ---- localserver --cluster 3 --port P --------------------------------------------------------
def _three_free_ports(attempt: int = 0) -> int:
    rnd = random.Random(os.getpid() * 100 + attempt)
    for _ in range(200):
        p = rnd.randrange(20000, 45000)
        if all(port_free(p + i) and port_free(p + i + 10000) for i in range(3)):
            return p
    raise RuntimeError("no three consecutive free ports")


def test_localserver_cluster_uses_consecutive_ports_and_prints_the_l3_url(tmp_path):
    for attempt in range(20):  # another test may take p + 1 between the check and the bind
        p, busy = _three_free_ports(attempt), socket.socket()
        try:
            busy.bind(("127.0.0.1", p + 1))
            break
        except OSError:
            busy.close()
    with busy:  # a taken port among the three: refused, one line
        busy.listen()
        r = subprocess.run([sys.executable, "-m", "hicache.l3.localserver", "--cluster", "3",
                            "--port", str(p), "--dir", str(tmp_path / "refused")],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"port {p + 1}" in r.stderr
    proc = subprocess.Popen([sys.executable, "-m", "hicache.l3.localserver", "--cluster", "3",
                             "--replicas", "0", "--port", str(p), "--dir", str(tmp_path / "cl")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = line.split()[0]
        assert url == ",".join(f"redis://127.0.0.1:{p + i}/0" for i in range(3)), line
        urls = url.split(",")  # what --l3-url splits
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            keys = _three_pages(urls, 0)  # through the cluster; the policy check runs
        assert not [w for w in seen if "maxmemory" in str(w.message)], \
            [str(w.message) for w in seen]
        with redis.RedisCluster.from_url(urls[0]) as c:
            assert {c.get_node_from_key(b"hicache:" + k).port for k in keys} <= set(
                range(p, p + 3))
            conf = c.config_get("maxmemory*", target_nodes="primaries")
            for node_conf in conf.values() if isinstance(next(iter(conf.values())), dict) \
                    else [conf]:
                assert int(node_conf["maxmemory"]) > 0
                assert node_conf["maxmemory-policy"].startswith("allkeys-")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert all(port_free(p + i) for i in range(3))  # the servers are stopped by PID


def test_ls_on_a_password_protected_server(tmp_path, redis_factory, capsys):
    srv = redis_factory(maxmemory=64 << 20)
    with redis.Redis(port=srv.port) as c:
        c.config_set("requirepass", "right-password-123")
    good = f"redis://:right-password-123@127.0.0.1:{srv.port}/0"
    _three_pages(good, 1)
    rc, out, err = run_cli(capsys, "l3", "ls", "--url", good, "--json")
    assert rc == 0, err
    assert [(r["model"], r["keys"], r["ranks"]) for r in json.loads(out)] == [
        ("admin-test", 3, [1])]
    bad = f"redis://:wrong-password-456@127.0.0.1:{srv.port}/0"
    rc, out, err = run_cli(capsys, "l3", "purge", "--url", bad, "--namespace", NS.digest.hex())
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert ": auth: " in err and "wrong-password-456" not in err and "***" in err, err
    assert registry.namespaces(good)[0].keys == 3  # nothing deleted
