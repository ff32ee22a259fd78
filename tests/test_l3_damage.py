"""Damaged, full and foreign L3 stores: the damage is made for real (truncated data.mdb, flipped
bytes in B-tree leaf pages and in a meta page, a file-size limit that fails commits like a full
disk, another application's environment), then the run must complete (without L3, said once
and counted) or stop with one line."""

import logging
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import lmdb
import numpy as np
import pytest
import torch

from hicache.errors import ConfigError, L3CorruptError, L3ForeignError
from hicache.commands import cli
from hicache.config import HiCacheConfig
from hicache.engine.model import MLAModel
from hicache.l3 import Namespace, PageStore, lmdb_check, page_keys
from hicache.l3.guard import GuardedStore
from hicache.l3.store import _checksum
from hicache.preflight import validate
from hicache.serving import Server, model_config
from hicache.service import HiCache
from hicache.workloads import Request

from helpers import make_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def damage_cfg(path, check_on_open=False) -> HiCacheConfig:
    return make_cfg(path, signature="damage-test", l3={"check_on_open": check_on_open},
                    prefetch="wait_complete", l3_cost_model=True)


def jobs(n=6, length=40):
    rng = np.random.default_rng(0)
    return [Request(i, i, rng.integers(0, 128, length), 3, i) for i in range(n)]


def serve(cfg, trace):
    torch.manual_seed(0)
    model = MLAModel(model_config(cfg))
    with HiCache(cfg, mode="l1+l2+l3") as cache:
        results = Server(model, cache, chunk_tokens=16, max_running=2).run(trace)
        cache.drain()
        stats = cache.stats()
    return [r.output for r in results], stats


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A real store written by a run (many values, several leaf pages), and that run's tokens."""
    path = tmp_path_factory.mktemp("l3") / "store"
    outputs, stats = serve(damage_cfg(path), jobs())
    assert stats["bytes"]["l3_write"] > 0
    return path, outputs


@pytest.fixture
def copy(store, tmp_path):
    path, _ = store
    dst = tmp_path / "store"
    shutil.copytree(path, dst)
    return dst


def psize(path) -> int:
    return lmdb_check.precheck(str(path))["psize"]


def pages_with_flag(path, flag) -> list[int]:
    data = (path / "data.mdb").read_bytes()
    ps = psize(path)
    return [i for i in range(2, len(data) // ps)
            if struct.unpack_from("<H", data, i * ps + 10)[0] & flag]


def flip(path, offsets, seed=0) -> None:
    rng = np.random.default_rng(seed)
    with open(path / "data.mdb", "r+b") as f:
        for off in offsets:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ int(rng.integers(1, 256))]))


def run_ends_without_l3(cfg, caplog, expect_outputs):
    """The run completes, token ids as the healthy run's, L3 off: said once, counted."""
    with caplog.at_level(logging.WARNING, logger="hicache"):
        outputs, stats = serve(cfg, jobs())
    said = [r for r in caplog.records if "continuing without L3" in r.getMessage()]
    assert len(said) == 1 and stats["l3_failures"] >= 1
    assert stats["hit_tokens"]["l3"] == 0
    assert outputs == expect_outputs


@pytest.mark.parametrize("cut", ["half", "last 4 KiB"])
def test_truncated_data_file_is_found_before_mapping(store, copy, caplog, cut):
    data = copy / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, size // 2 if cut == "half" else size - 4096)
    with pytest.raises(L3CorruptError, match="truncated: .* ends at byte"):
        lmdb_check.precheck(str(copy))
    with pytest.raises(L3CorruptError, match="is damaged"):
        PageStore(copy, Namespace.from_config(damage_cfg(copy)), 0, 64 << 20)
    run_ends_without_l3(damage_cfg(copy), caplog, store[1])
    # the parent's check says so too, as a warning: the run goes on without L3
    (w,) = validate(damage_cfg(copy), engine=False, memory=False)
    assert "the store is damaged" in w and "--quarantine" in w


def test_an_empty_data_file_is_a_store_being_created(tmp_path):
    # a rank that opens the store while another rank's LMDB has created data.mdb but not yet
    # written its meta pages (ranks of one node start together) sees 0 bytes: that is a new
    # store (LMDB initialises an empty file under its lock), not damage
    d = tmp_path / "new"
    d.mkdir()
    (d / "data.mdb").touch()
    assert lmdb_check.precheck(str(d)) is None
    ns = Namespace.from_config(damage_cfg(d))
    with PageStore(d, ns, 0, 64 << 20) as st:
        shard = torch.ones(ns.shard_shape, dtype=ns.torch_dtype)
        key = page_keys(list(range(ns.page_tokens)), ns.page_tokens, ns, 0)
        assert st.put(key, [shard]).written == 1 and st.exists_prefix(key) == 1


def test_damaged_meta_page(store, copy, caplog):
    ps = psize(copy)
    flip(copy, range(ps + 16, ps + 24))  # meta page 1: magic and version
    with pytest.raises(L3CorruptError, match="meta page 1 is damaged"):
        lmdb_check.precheck(str(copy))
    run_ends_without_l3(damage_cfg(copy), caplog, store[1])


def test_flipped_leaf_bytes_are_caught_in_a_child(store, copy, caplog):
    ps = psize(copy)
    leaves = pages_with_flag(copy, 0x02)  # P_LEAF
    assert len(leaves) >= 2
    rng = np.random.default_rng(1)
    flip(copy, [p * ps + 16 + int(rng.integers(0, ps - 16)) for p in leaves for _ in range(40)])
    report = lmdb_check.check_in_child(str(copy), timeout_s=120)
    assert not report["ok"], report
    # the whole walk runs in a child: whatever the damage does there, this process goes on
    run_ends_without_l3(damage_cfg(copy, check_on_open=True), caplog, store[1])


def test_damaged_values_are_reported(store, copy):
    with lmdb.open(str(copy), max_dbs=8, readonly=True) as env:
        with env.begin() as txn:
            value = next(iter(txn.cursor(db=env.open_db(b"data", txn=txn, create=False))))[1]
    at = (copy / "data.mdb").read_bytes().find(value)
    assert at > 0
    flip(copy, [at + len(value) // 2])  # one byte inside one stored value
    report = lmdb_check.check_in_child(str(copy), timeout_s=120)
    assert report["bad_values"] == 1 and not report["ok"] and report["error"] is None


def test_l3_check_command_reports_and_quarantines(store, copy, capsys):
    assert cli.main(["l3", "check", str(copy)]) == 0
    assert "ok:" in capsys.readouterr().out
    os.truncate(copy / "data.mdb", (copy / "data.mdb").stat().st_size // 2)
    assert cli.main(["l3", "check", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED: " in out and "truncated" in out and copy.exists()
    assert cli.main(["l3", "check", str(copy), "--quarantine"]) == 1
    out = capsys.readouterr().out.strip()
    moved = out.split("moved to ")[1]
    assert not copy.exists() and os.path.exists(os.path.join(moved, "data.mdb"))
    assert cli.main(["l3", "check", str(copy)]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_a_store_error_at_run_time_ends_l3_once(store, copy, caplog):
    cfg = damage_cfg(copy)
    ns = Namespace.from_config(cfg)
    with caplog.at_level(logging.WARNING, logger="hicache"):
        g = GuardedStore(lambda: PageStore(copy, ns, 0, 64 << 20), str(copy), 0, ns)
        g._store._env.close()  # every later LMDB call raises lmdb.Error
        assert g.exists_prefix([]) == 0 and not g.failed
        assert g.get(g._check_keys(_some_keys(g)), lambda i: None) == 0
        assert g.failed and g.failures == 1
        keys = _some_keys(g)
        shards = [torch.zeros(ns.shard_shape, dtype=ns.torch_dtype)] * len(keys)
        assert g.exists_prefix(keys) == 0
        assert g.put(keys, shards).stored == (False, False)
        g.close()
    assert sum("continuing without L3" in r.getMessage() for r in caplog.records) == 1


def _some_keys(g):
    from hicache.l3 import page_keys
    return page_keys(np.arange(8), g.namespace.page_tokens, g.namespace, 0)


def test_full_disk_drops_writes_and_the_run_completes(tmp_path):
    """A file-size limit makes LMDB's commit fail as on a full disk ("mdb_txn_commit:
    Input/output error"): writes are dropped and counted, reads keep working."""
    code = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        from test_l3_damage import damage_cfg, jobs, serve
        cfg = damage_cfg({str(tmp_path / "l3")!r})
        first, _ = serve(cfg, jobs(n=2))          # some pages stored while there is room
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        size = __import__("os").path.getsize({str(tmp_path / "l3" / "data.mdb")!r})
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        out, stats = serve(cfg, jobs(n=8))
        print(stats["l3_errors"], stats["l3_failures"], stats["hit_tokens"]["l3"])
    """)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    write_errors, failures, l3_hits = map(int, r.stdout.split()[-3:])
    assert write_errors >= 1 and failures == 0
    assert l3_hits > 0  # the pages stored before the disk filled are still served


def test_another_applications_environment_is_refused(tmp_path, capsys):
    path = tmp_path / "theirs"
    env = lmdb.open(str(path), max_dbs=4)
    users = env.open_db(b"users")
    with env.begin(write=True) as txn:
        txn.put(b"alice", b"1", db=users)
    env.close()
    cfg = damage_cfg(path)
    with pytest.raises(L3ForeignError, match="not a hicache store .*users"):
        PageStore(path, Namespace.from_config(cfg), 0, 64 << 20)
    with pytest.raises(ConfigError, match="l3.lmdb.path: .* is not a hicache store"):
        validate(cfg, engine=False, memory=False)
    with pytest.raises(ConfigError, match="not a hicache store"):  # HiCache runs the same check
        HiCache(cfg, mode="l1+l2+l3")
    ns = Namespace.from_config(cfg)
    with pytest.raises(L3ForeignError):  # and the store itself refuses, guarded or not
        GuardedStore(lambda: PageStore(path, ns, 0, 64 << 20), str(path), 0, ns)
    with lmdb.open(str(path), max_dbs=4, readonly=True) as env:  # untouched: no sub-db added
        with env.begin() as txn:
            assert [bytes(k) for k, _ in txn.cursor()] == [b"users"]
    assert cli.main(["l3", "check", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "not a hicache store" in line


def test_checksum_matches_the_store():
    key, buf = b"k" * 40, os.urandom(100)
    assert lmdb_check.checksum(key, buf) == _checksum(key, buf)
