"""Fault injection (hicache.faults): the seeded plan, each L3 fault as a counted miss, and the
short soak (hicache-bench --duration --faults) on 2 real ranks."""

import json
import random

import numpy as np
import pytest
import torch

from hicache.errors import TransferError
from hicache.commands import bench as bench_cli
from hicache.l3 import chain_hashes
from hicache.faults import FaultConfig, FaultInjector, InjectedFault, corrupt_values
from hicache.service import HiCache

from helpers import write_kv_rows, admit_ready, make_cfg, secret_file
from test_metrics import bench_config

# L1 and L2 smaller than the trace: every pass evicts, backs up (D2H), loads back (H2D) and
# restores from L3, so every fault kind has something to hit.
SOAK_L1_PAGES = 28


def test_every_rank_draws_the_same_plan_and_only_the_target_acts():
    injs = [FaultInjector(FaultConfig(7, gap_steps=(1, 3)), r, 2) for r in range(2)]

    class Quiet:  # the kinds acted on at plan time need a cache; none of them here
        l3 = None
    for _ in range(200):
        for inj in injs:
            inj._local = random.Random(0)
            inj.config.late_s = (0.0, 0.0)
            inj.on_step(Quiet())
    a, b = injs
    assert a.events == b.events and len(a.events) > 50
    assert set(a.planned) == set(FaultConfig(7).kinds)  # a shuffled cycle: every kind comes
    targets = {k: {t for _s, kk, t in a.events if kk == k} for k in a.planned}
    assert all(t <= {0, 1} for t in targets.values())
    late = sum(1 for _s, k, t in a.events if k == "late_step" and t == 0)
    assert a.injected["late_step"] == late and b.injected["late_step"] == a.planned[
        "late_step"] - late
    # another seed, another plan
    c = FaultInjector(FaultConfig(8, gap_steps=(1, 3)), 0, 2)
    c.config.late_s = (0.0, 0.0)
    for _ in range(200):
        c.on_step(Quiet())
    assert c.events != a.events


def _stored_prompt(cache, tokens):
    """Serve ``tokens`` once and push its pages to L3."""
    p = admit_ready(cache, "w", tokens)
    rows = torch.arange(len(tokens), dtype=torch.int64)
    for layer in range(cache.l1.kv.shape[0]):
        table = torch.tensor(p.page_table)
        slots = table[rows // cache.page_tokens] * cache.page_tokens + rows % cache.page_tokens
        cache.write_kv(layer, slots, torch.randn(len(tokens), cache.l1.kv.shape[-1]))
    cache.finish("w", tokens)
    cache.drain()


@pytest.mark.parametrize("kind", ["l3_corrupt", "l3_delete", "l3_error"])
def test_each_l3_fault_is_a_counted_miss(tmp_path, kind):
    cfg = make_cfg(tmp_path / "l3", l1_pages=24, prefetch="wait_complete")
    tokens = np.random.default_rng(1).integers(0, 128, 33)
    with HiCache(cfg, mode="l1+l2+l3") as cache:
        _stored_prompt(cache, tokens)
        keys = cache.io.keys(chain_hashes(tokens[:32], cache.page_tokens))
        assert cache.l3.exists_prefix(keys) == 8
    with HiCache(cfg, mode="l1+l2+l3") as cache:  # cold L1/L2: the prompt can only hit L3
        inj = FaultInjector(FaultConfig(0), 0, 1)
        inj.install(cache)
        assert "step" in vars(cache) and HiCache.step is not cache.step
        if kind == "l3_corrupt":
            assert corrupt_values(cache.l3, 100, random.Random(0)) == 8
        elif kind == "l3_delete":
            inj._armed.delete_reads = 1
        else:
            inj._armed.error_reads = 1
        p = admit_ready(cache, "r", tokens, alloc=False)
        assert p.storage_len == 0  # nothing restored: every page was a miss
        s = cache.stats()
        assert s["hit_tokens"]["l3"] == 0 and s["miss_tokens"] == len(tokens)
        if kind == "l3_corrupt":
            assert s["corrupt"] == 1  # the first page is rejected, the read stops there
        elif kind == "l3_delete":
            assert inj.injected["l3_delete"] == 1 and inj.l3_misses == 1
            assert cache.l3.exists_prefix(keys) == 0
        else:
            # the contract for a store that errors: a counted miss, never a raise
            assert inj.injected["l3_error"] == 1 and s["l3_errors"] == 1
        cache.finish("r", tokens[:0])


def test_an_injected_copy_failure_stops_the_step_and_a_cache_without_faults_is_untouched(
        tmp_path):
    cfg = make_cfg(tmp_path / "l3", l1_pages=24)
    plain = HiCache(cfg, mode="l1+l2")
    assert "step" not in vars(plain) and "copy" not in vars(plain.transfer.backend)  # zero cost
    plain.close()
    cache = HiCache(cfg, mode="l1+l2")
    inj = FaultInjector(FaultConfig(0), 0, 1)
    inj.install(cache)
    inj._armed.fail["d2h"] = 1
    tokens = np.random.default_rng(2).integers(0, 128, 16)
    cache.admit("a", tokens)
    cache.alloc("a", 16)
    write_kv_rows(cache, "a", 16)
    cache.finish("a", tokens)  # write-through backup: its D2H copy is the injected failure
    with pytest.raises(TransferError, match="injected d2h copy failure"):
        cache.drain()
    assert cache.stats()["failed_copies"]["d2h"] == 1 and inj.injected["d2h_fail"] == 1
    cache.close(flush=False)
    assert isinstance(InjectedFault("x"), OSError)


def test_short_fault_soak_on_two_ranks(tmp_path, capsys):
    cfg = tmp_path / "policy.toml"
    cfg.write_text(bench_config(tmp_path / "unused", SOAK_L1_PAGES))
    out = tmp_path / "soak.json"
    # 12 s: an armed h2d_fail fires only at the target rank's next load-back, and a loaded
    # machine serves few revisits in 8 s (seen once with no h2d fault injected)
    rc = bench_cli.main(["--config", str(cfg), "--workload", "chat", "--scale", "0.01",
                         "--max-output", "3", "--max-running", "2", "--duration", "12", "--faults", "3",
                         "--fault-every", "3", "--no-progress", "--out", str(out)])
    text = capsys.readouterr()
    f = json.loads(out.read_text())["faults"]
    assert set(f) >= {"injected", "wrong_tokens", "hung_collectives", "leaked_pages",
                      "leaked_locks", "service_restarts", "l3_misses_from_faults",
                      "requests_completed"}
    assert "fault soak" in text.out and "wrong_tokens" in text.out
    for kind in FaultConfig(3).kinds:  # a shuffled cycle: the first injections cover all
        assert f["injected"][kind] >= 1, (kind, f["injected"])
    assert f["wrong_tokens"] == 0 and f["tokens_checked"] > 0
    assert f["hung_collectives"] == 0 and not f["errors"]
    assert f["leaked_pages"] == 0 and f["leaked_locks"] == 0
    # each injected copy failure stopped both ranks at the same step, then a fresh service
    assert f["service_restarts"] >= 1 and f["failures_agreed"]
    errs = f["failure_errors"]
    assert all(len(e) == f["service_restarts"] for e in errs)
    assert any("injected d2h copy failure" in m for e in errs for m in e)
    assert any("another rank" in m for e in errs for m in e)
    assert f["l3_misses_from_faults"] >= 1 and f["requests_completed"] > 0
    assert f["hit_tokens"]["l3"] > 0  # L3 was on the read path: its faults had effect
    assert not (tmp_path / "unused").exists()  # the soak's L3 is its own temporary store
    assert f["problems"] == [p for p in f["problems"] if "deadline" in p or "memory" in p]
    assert rc == (1 if f["problems"] else 0)
    # the served rows and first-token logits were compared with recompute's: no false alarm
    assert f["kv_pages_checked"] > 0 and f["kv_corrupt_pages"] == 0
    assert f["logits_checked"] > 0 and f["logits_differ"] == 0
    assert "kv_corrupt_pages" in text.out and "logits max |diff|" in text.out


def test_a_soak_serving_corrupt_kv_reports_it(tmp_path, capsys):
    """The mutation (``kv_corrupt``): L2 pages get noise, which no checksum sees (L2 has none,
    and L3 values backed up from those pages carry a valid one). Tokens of the tiny model may
    not move; the soak's comparison of served rows and logits must fail the run."""
    cfg = tmp_path / "policy.toml"
    cfg.write_text(bench_config(tmp_path / "unused", SOAK_L1_PAGES))
    out = tmp_path / "soak.json"
    rc = bench_cli.main(["--config", str(cfg), "--workload", "chat", "--scale", "0.01",
                         "--max-output", "3", "--max-running", "2", "--duration", "8",
                         "--faults", "5", "--fault-every", "2", "--fault-kinds", "kv_corrupt",
                         "--no-progress", "--out", str(out)])
    text = capsys.readouterr()
    f = json.loads(out.read_text())["faults"]
    assert f["injected"]["kv_corrupt"] >= 1 and set(f["injected"]) >= {"kv_corrupt"}
    assert f["kv_corrupt_pages"] > 0, f
    assert f["kv_max_abs_diff"] > 0.1
    assert any("served KV differs from recompute's rows" in p for p in f["problems"])
    assert rc == 1 and "FAIL faults: served KV differs" in text.err
    assert bench_cli.main(["--config", str(cfg), "--faults", "1", "--duration", "5",
                           "--fault-kinds", "kv_corrupt,bogus"]) == 2
    assert "--fault-kinds: unknown kind 'bogus'" in capsys.readouterr().err


def test_fault_soak_arguments(tmp_path, capsys):
    cfg = tmp_path / "policy.toml"
    cfg.write_text(bench_config(tmp_path / "l3"))
    assert bench_cli.main(["--config", str(cfg), "--faults", "1"]) == 2
    assert "--duration" in capsys.readouterr().err
    assert bench_cli.main(["--config", str(cfg), "--faults", "1", "--duration", "5",
                           "--dcp", "1"]) == 2
    assert "2 or more ranks" in capsys.readouterr().err
    assert bench_cli.main(["--config", str(cfg), "--faults", "1", "--duration", "5", "--reps",
                           "2", "--cold-l3"]) == 2
    assert "--reps, --cold-l3: not used by the fault soak" in capsys.readouterr().err


def test_short_fault_soak_on_redis_kills_and_restarts_its_own_server(tmp_path, capsys,
                                                                     redis_factory, monkeypatch):
    # the configured server is only a switch to the Redis backend: the soak starts (and kills)
    # its own, so the user's server keeps its data and keeps running
    user = redis_factory()
    monkeypatch.setenv("HICACHE_L3_SECRET_FILE", secret_file(tmp_path))  # authenticated L3
    cfg = tmp_path / "policy.toml"
    cfg.write_text(bench_config(tmp_path / "unused", SOAK_L1_PAGES))
    out = tmp_path / "soak.json"
    rc = bench_cli.main(["--config", str(cfg), "--l3-url", user.url, "--workload", "chat",
                         "--scale", "0.01", "--max-output", "3", "--max-running", "2",
                         "--duration", "10", "--faults", "1", "--fault-every", "12",
                         "--no-progress", "--out", str(out)])
    capsys.readouterr()
    f = json.loads(out.read_text())["faults"]
    assert f["l3_backend"] == "redis"
    # seed 1 kills the server first (step 8): calls fail fast, bounded, counted, then it is back
    assert f["injected"]["l3_restart"] >= 1 and f["l3_errors"] > 0
    assert f["wrong_tokens"] == 0 and f["hung_collectives"] == 0 and not f["errors"]
    assert f["leaked_pages"] == 0 and f["leaked_locks"] == 0 and f["failures_agreed"]
    assert f["hit_tokens"]["l3"] > 0 and f["requests_completed"] > 0  # served again
    assert user.proc.poll() is None  # the user's server was never touched
    import redis
    assert redis.Redis.from_url(user.url).dbsize() == 0
    assert rc == (1 if f["problems"] else 0)
