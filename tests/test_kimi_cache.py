"""Prefix hits for a hybrid model (Kimi Linear) through the serving loop and the cache.

A tiny Kimi Linear checkpoint (written by transformers, as in test_kimi_engine.py) is served by
``hicache.serving.Server`` with the cache on and off: the serving loop asks the runner for the
KDA state at the page-aligned positions the cache wants, the cache keeps each snapshot on the
page that ends there, and a hit restores it before the first extend. Every check compares the
tokens, the first generated token's logits and the served KV rows with recompute
(``hicache.kvcheck``).
"""

import numpy as np
import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.errors import ConfigError
from hicache.kvcheck import KVProbe, compare
from hicache.serving import Server
from hicache.service import HiCache
from hicache.workloads import Request

from test_kimi_engine import make_checkpoint

PS = 2  # page size (dcp 1: 2-token pages)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi_cache") / "ckpt"
    make_checkpoint(d, kda=[1, 2, 4], full=[3], first_dense=1, seed=3)
    return str(d)


def cfg_of(path, every=0, state_bytes=1 << 20, l1_pages=64, l2_ratio=2.0, **policy):
    return HiCacheConfig.from_dict({
        "model": {"path": path, "signature": "kimi-test"}, "cache": {"page_size": PS},
        "l1": {"num_pages": l1_pages}, "l2": {"ratio": l2_ratio},
        "hybrid": {"snapshot_every_pages": every, "l1_state_bytes": state_bytes},
        "policy": {"l3_cost_model": False, **policy}})


def toks(seed, n):
    return np.random.default_rng(seed).integers(3, 90, n).astype(np.int64)


def serve(cfg, jobs, mode):
    from hicache.checkpoints.hf import load_model
    model = load_model(cfg.model.path)
    with HiCache(cfg, mode=mode) as cache:
        probe = KVProbe(cache.kv, cache.page_tokens, all_pages=mode == "recompute")
        server = Server(model, cache, chunk_tokens=5, max_running=1, probe=probe)
        # one run per job: each ends with its transfers agreed (L2 copies valid)
        res = {r.request_id: r for j in jobs for r in server.run([j])}
        stats = cache.stats()
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}
        if cache.companion("hybrid") is not None:
            cache.ctrl.check()
    return res, stats, probe.result()


def same_as_recompute(cfg, jobs, mode):
    ref, _, ref_probe = serve(cfg, jobs, "recompute")
    got, stats, probe = serve(cfg, jobs, mode)
    assert {k: r.output for k, r in got.items()} == {k: r.output for k, r in ref.items()}
    cmp = compare(ref_probe, probe)
    assert cmp.ok, cmp.line()
    return got, stats


def jobs_sharing(prefix_len, tail=5, out=3):
    """A (prefix + tail), B (the same prefix, another tail right after it), A again."""
    base = toks(1, prefix_len)
    a = np.concatenate([base, toks(2, tail)])
    b = np.concatenate([base, toks(3, tail)])
    return [Request("A", 0, a, out, 0), Request("B", 0, b, out, 1),
            Request("A2", 0, a.copy(), out, 2)]


@pytest.mark.parametrize("mode", ["l1", "l1+l2"])
def test_snapshot_every_pages_hits_a_shared_prefix_right_after_a_snapshot(kimi, mode):
    cfg = cfg_of(kimi, every=2)  # snapshots every 4 tokens, and at the end of each prefix
    got, stats = same_as_recompute(cfg, jobs_sharing(8), mode)
    assert got["B"].hit["l1"] == 8      # differs right after the snapshot at 8
    assert got["A2"].hit["l1"] == 12    # A's prompt: 13 tokens, the last never a hit
    h = stats["hybrid"]
    assert h["hits"]["l1"] == 2 and h["lost_tokens"] == 0
    assert h["written_bytes"]["l1"] > 0 and h["read_bytes"]["l1"] == 2 * h["snapshot_bytes"]
    if mode == "l1+l2":
        assert h["written_bytes"]["l2"] == h["written_bytes"]["l1"]


def test_only_prefix_ends_cut_a_shared_prefix_back_and_count_the_loss(kimi):
    cfg = cfg_of(kimi, every=0)
    e = toks(5, 13)  # a turn of one token (fed: its 13 prompt tokens), then the next turn
    jobs = jobs_sharing(8) + [Request("E", 0, e, 1, 3),
                              Request("F", 0, np.concatenate([e, toks(6, 4)]), 2, 4)]
    got, stats = same_as_recompute(cfg, jobs, "l1")
    assert got["F"].hit["l1"] == 12  # E's inserted prefix ends at 12: its snapshot
    # B shares 8 tokens with A, but A's only snapshot is at the end of its 15 fed tokens (14):
    # B's 8 matched tokens are recomputed (lost); A2's match (12 tokens) ends before it too
    assert got["B"].hit["l1"] == 0
    assert stats["hybrid"]["lost_tokens"] >= 8
    assert stats["hit_tokens"]["l1"] == sum(r.hit["l1"] for r in got.values())


def test_a_hit_from_l2_restores_the_snapshot_s_host_copy(kimi):
    one = HiCacheConfig.from_dict({"model": {"path": kimi}}).state_format.page_bytes
    # L1: 12 pages and 2 snapshots; L2: 48 pages and 8 snapshots. C evicts A's pages and
    # A's snapshots from L1; A2 then loads A's pages and its snapshot at 12 from L2
    cfg = cfg_of(kimi, every=2, state_bytes=2 * one, l1_pages=12, l2_ratio=4.0)
    jobs = jobs_sharing(8)
    jobs[1:2] = [Request("C", 0, toks(7, 13), 3, 1)]
    got, stats = same_as_recompute(cfg, jobs, "l1+l2")
    assert got["A2"].hit == {"l1": 0, "l2": 12, "l3": 0}
    h = stats["hybrid"]
    assert h["hits"] == {"l1": 0, "l2": 1, "l3": 0} and h["read_bytes"]["l2"] == one


def test_an_evicted_snapshot_shortens_the_hit_and_tokens_stay_equal(kimi):
    from hicache.checkpoints.hf import load_model
    a = jobs_sharing(8)[0]
    again = Request("A2", 0, a.tokens.copy(), a.output_len, 1)
    model = load_model(kimi)
    runs = {}
    for mode in ("recompute", "l1"):
        with HiCache(cfg_of(kimi, every=2), mode=mode) as cache:
            server = Server(model, cache, chunk_tokens=5, max_running=1)
            first = server.run([a])
            if mode == "l1":  # evict the snapshot at 12 (A2's whole match) on its own
                pages = cache.ctrl.cached_pages()
                snaps = cache.ctrl.snaps
                s12 = next(s for s in snaps.all() if s.pages * PS == 12)
                snaps.evict(s12)
                assert cache.ctrl.cached_pages() == pages  # no page freed
            runs[mode] = first + server.run([again])
            stats = cache.stats()
            cache.ctrl.check()
    assert [r.output for r in runs["l1"]] == [r.output for r in runs["recompute"]]
    assert runs["l1"][1].hit["l1"] == 8  # cut back to the snapshot at 8
    assert stats["hybrid"]["lost_tokens"] == 4


def test_a_full_snapshot_pool_evicts_the_least_recently_used(kimi):
    one = HiCacheConfig.from_dict({"model": {"path": kimi}}).state_format.page_bytes
    cfg = cfg_of(kimi, every=0, state_bytes=2 * one)  # room for 2 snapshots
    jobs = jobs_sharing(8)
    jobs.insert(2, Request("C", 0, toks(7, 13), 3, 2))  # A, B, C, A2: C evicts A's snapshot
    got, stats = same_as_recompute(cfg, jobs, "l1")
    h = stats["hybrid"]
    assert h["held_bytes"]["l1"] == 2 * one
    assert got["A2"].hit["l1"] == 0 and h["lost_tokens"] >= 12  # A's pages are still cached


def test_bad_snapshot_pool_and_deepseek_untouched(kimi, tmp_path):
    with pytest.raises(ConfigError, match=r"^hybrid.l1_state_bytes: 100 bytes hold no KDA"):
        cfg_of(kimi, state_bytes=100)
    plain = HiCacheConfig.from_dict({"cache": {"page_size": PS}, "l1": {"num_pages": 8}})
    assert plain.state_format is None
    with HiCache(plain, mode="l1") as cache:
        assert cache.companion("hybrid") is None and cache.ctrl.snaps is None
        assert "hybrid" not in cache.stats()


def test_check_config_plan_and_memory_count_snapshot_bytes(kimi, tmp_path, capsys):
    import json
    from hicache import preflight
    from hicache.commands import cli
    cfg = cfg_of(kimi, state_bytes=1 << 20)
    fmt = cfg.state_format
    assert fmt.kind.value == "state" and fmt.layers == 3  # one fp32 row per KDA layer
    small = preflight.memory_need(cfg_of(kimi, state_bytes=1 << 16), 1)
    big = preflight.memory_need(cfg, 1)
    n_small, n_big = (1 << 16) // fmt.page_bytes, (1 << 20) // fmt.page_bytes
    assert big.l1_per_rank - small.l1_per_rank == (n_big - n_small) * fmt.page_bytes
    assert big.l2_per_rank - small.l2_per_rank == 2 * (n_big - n_small) * fmt.page_bytes
    f = tmp_path / "p.toml"
    f.write_text(f'[model]\npath = "{kimi}"\n[hybrid]\nl1_state_bytes = {1 << 20}\n')
    assert cli.main(["check-config", str(f), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["snapshot_bytes"] == fmt.page_bytes and f"L1 {n_big} snapshots" in \
        info["snapshots"]
    f.write_text(f'[model]\npath = "{kimi}"\n[hybrid]\nl1_state_bytes = 100\n')
    assert cli.main(["check-config", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hybrid.l1_state_bytes: 100 bytes hold no KDA state" in err[0]
    assert cli.main(["plan", "--model", "kimi-linear-48b-a3b", "--tp", "8", "--json"]) == 0
    hyb = json.loads(capsys.readouterr().out)["hybrid"]
    assert hyb["snapshot_cache_bytes"] == 20 * (3 * 32 * 128 * 3 * 4 + 32 * 128 * 128 * 4)


def test_bench_reports_snapshots_by_tier_and_verifies(kimi, tmp_path, capsys):
    import json
    from hicache.commands import bench as bench_cli
    out = tmp_path / "r.json"
    f = tmp_path / "p.toml"
    f.write_text(f'[cache]\npage_size = 4\n[l1]\nnum_pages = 64\n[hybrid]\n'
                 f'snapshot_every_pages = 1\nl1_state_bytes = {1 << 20}\n'
                 f'[policy]\nl3_cost_model = false\n')
    rc = bench_cli.main(["--config", str(f), "--model", kimi, "--dcp", "1", "--workload",
                         "chat", "--scale", "0.01", "--max-output", "2", "--modes", "l1,l1+l2",
                         "--verify", "--no-progress", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["workloads"][0]["verify"]["equal"] is True
    modes = {m["name"]: m for m in report["modes"]}
    for name in ("l1", "l1+l2"):
        h = modes[name]["hybrid"]
        assert h["snapshot_hits"]["l1"] > 0 and h["written_bytes"]["l1"] > 0
        assert modes[name]["hit_tokens"]["l1"] > 0
        assert f"{name} snapshots ({h['snapshot_bytes']} bytes): hits l1 " in text
        assert "tokens lost to truncation" in text
    assert modes["l1+l2"]["hybrid"]["written_bytes"]["l2"] > 0
    f.write_text('[hybrid]\nl1_state_bytes = 10\n')
    assert bench_cli.main(["--config", str(f), "--model", kimi, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hybrid.l1_state_bytes" in err[0]


def test_bench_hybrid_script_prints_ttft_and_restore_ratios():
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "bench" / "hybrid.py"), "--quick", "--json",
                        "--length", "64", "--suffix", "4", "--reps", "1"],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens_equal"] is True and out["hit_tokens"] == [out["length"]]
    assert abs(out["ttft_speedup"] - out["ttft_recompute_s"] / out["ttft_hit_s"]) < 1e-9
    assert abs(out["restore_over_kda_prefill"] - out["restore_s"] / out["kda_prefill_s"]) < 1e-9
    bad = subprocess.run([sys.executable, str(root / "bench" / "hybrid.py"), "--length", "10"],
                         capture_output=True, text=True, timeout=60, cwd=root)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --length: 10")


def test_a_snapshot_taken_while_decoding_serves_the_next_turn(kimi):
    """every_pages 0: A's only snapshot is at the end of its fed tokens (prompt 9 + 5 fed
    outputs = 14), a position its decode steps reach, batched with another request's."""
    from hicache.checkpoints.hf import load_model
    model = load_model(kimi)
    a = Request("A", 0, toks(11, 9), 6, 0)
    other = Request("O", 0, toks(12, 7), 6, 1)
    outs = {}
    for mode in ("recompute", "l1"):
        with HiCache(cfg_of(kimi, every=0), mode=mode) as cache:
            probe = KVProbe(cache.kv, cache.page_tokens, all_pages=mode == "recompute")
            server = Server(model, cache, chunk_tokens=4, max_running=2, probe=probe)
            first = {r.request_id: r for r in server.run([a, other])}
            fed = np.concatenate([a.tokens, np.asarray(first["A"].output[:-1], np.int64)])
            turn = Request("T", 0, np.concatenate([fed, toks(13, 3)]), 3, 2)
            (t,) = server.run([turn])
            outs[mode] = ({k: r.output for k, r in first.items()}, t.output, t.hit,
                          probe.result())
    assert outs["l1"][:2] == outs["recompute"][:2]
    assert outs["l1"][2]["l1"] == 14  # the snapshot at 14, taken by a decode step
    cmp = compare(outs["recompute"][3], outs["l1"][3])  # T's first logits and served KV
    assert cmp.ok, cmp.line()
