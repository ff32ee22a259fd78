"""hicache-bench end to end (in-process at dcp 1; the 2-rank path is covered in test_service)."""

import json

import pytest

from hicache.commands import bench as bench_cli

from helpers import l3_writes_land_at_once, policy_toml, secret_file

MODE_KEYS = {"name", "hit_ratio", "hit_tokens", "prompt_tokens", "ttft_s", "throughput_tok_s",
             "bytes", "controller_us_per_request", "evictions"}


@pytest.fixture
def cfg_file(tmp_path):
    f = tmp_path / "policy.toml"
    f.write_text(policy_toml(tmp_path / "l3", page_size=8, l2_ratio=1.0,
                             policy={"prefetch": "wait_complete", "l3_cost_model": False}))
    return f


def bench(cfg_file, tmp_path, *args, name="run"):
    out = tmp_path / f"{name}.json"
    rc = bench_cli.main(["--config", str(cfg_file), "--workload", "chat", "--scale", "0.01",
                         "--max-output", "3", "--no-progress", "--out", str(out), *args])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_json_shape_table_verify_and_warm_restart(cfg_file, tmp_path, capsys):
    rc, report = bench(cfg_file, tmp_path, "--verify", name="first")
    assert rc == 0
    text = capsys.readouterr().out
    for mode in ("recompute", "l1", "l1+l2", "l1+l2+l3"):
        assert mode in text
    assert "verify: token ids equal to recompute in every mode" in text
    assert report["workloads"][0]["verify"]["equal"] is True
    kv = report["workloads"][0]["verify"]["kv"]  # the rows each served page brought, too
    assert set(kv) == {"l1", "l1+l2", "l1+l2+l3"}
    for m, c in kv.items():
        assert c["bad_pages"] == 0 and c["bad_logits"] == 0 and c["requests"] > 0, (m, c)
        assert f"verify {m}: KV of {c['pages']} served pages" in text
    assert kv["l1"]["pages"] > 0 and kv["l1"]["bitwise"] > 0
    assert "probes" not in report["modes"][0]  # compared, not reported
    assert {"modes", "config", "machine"} <= set(report)
    modes = {m["name"]: m for m in report["modes"]}
    assert list(modes) == ["recompute", "l1", "l1+l2", "l1+l2+l3"]
    for m in modes.values():
        assert MODE_KEYS <= set(m)
        assert set(m["hit_tokens"]) == {"l1", "l2", "l3"}
        assert set(m["ttft_s"]) == {"p50", "p90", "p99"}
        assert set(m["bytes"]) == {"d2h", "h2d", "l3_read", "l3_write"}
        assert m["prompt_tokens"] == modes["recompute"]["prompt_tokens"]
        assert m["outputs"] == modes["recompute"]["outputs"]
    assert modes["recompute"]["hit_ratio"] == 0
    assert 0 < modes["l1"]["hit_ratio"] and 0 < report["workloads"][0]["ideal_hit_ratio"] <= 1
    assert modes["l1+l2+l3"]["bytes"]["l3_write"] > 0
    # a second run on the same L3 path starts warm: the very first request of the trace, which
    # can hit nothing in a cold start, is served from the store
    first = {r["id"]: r for r in modes["l1+l2+l3"]["requests"]}["0"]
    assert sum(first["hit_tokens"].values()) == 0
    rc, again = bench(cfg_file, tmp_path, "--modes", "l1+l2+l3", name="second")
    assert rc == 0
    warm = again["modes"][0]
    assert {r["id"]: r for r in warm["requests"]}["0"]["hit_tokens"]["l3"] > 0
    assert warm["outputs"] == modes["recompute"]["outputs"]


def test_shared_l3_url_second_group_starts_warm(cfg_file, tmp_path, redis_url, monkeypatch):
    """Two runs are two independent groups of processes: the second restores the first's
    pages from the shared Redis store, with the same tokens (authenticated: the fleet secret
    comes from the environment)."""
    monkeypatch.setenv("HICACHE_L3_SECRET_FILE", secret_file(tmp_path))
    rc, a = bench(cfg_file, tmp_path, "--modes", "recompute,l1+l2+l3", "--l3-url", redis_url,
                  name="a")
    assert rc == 0 and a["config"]["l3"]["backend"] == "redis"
    rc, b = bench(cfg_file, tmp_path, "--modes", "l1+l2+l3", "--l3-url", redis_url, name="b")
    assert rc == 0
    cold, warm = a["modes"][1], b["modes"][0]
    assert {r["id"]: r for r in cold["requests"]}["0"]["hit_tokens"]["l3"] == 0
    assert {r["id"]: r for r in warm["requests"]}["0"]["hit_tokens"]["l3"] > 0
    assert warm["outputs"] == a["modes"][0]["outputs"]  # equal to recompute
    # (later L3 hits depend on the measured load-vs-recompute cost, so on timing: not asserted)


def test_verify_always_compares_with_recompute_and_can_fail(cfg_file, tmp_path, capsys,
                                                             monkeypatch):
    real = bench_cli.run_mode
    ran = []

    def recording(cfg, mode, jobs, opts):
        ran.append(mode)
        return real(cfg, mode, jobs, opts)
    monkeypatch.setattr(bench_cli, "run_mode", recording)
    rc, report = bench(cfg_file, tmp_path, "--modes", "l1+l2+l3", "--verify", name="v1")
    out = capsys.readouterr()
    assert rc == 0 and ran == ["l1+l2+l3", "recompute"]  # recompute run for the comparison
    assert [m["name"] for m in report["modes"]] == ["l1+l2+l3"]
    v = report["workloads"][0]["verify"]
    assert v["reference"] == "recompute" and v["equal"] and v["requests"] > 0
    assert "token ids equal to recompute" in out.out

    def corrupted(cfg, mode, jobs, opts):  # one wrong token in one request of the cached mode
        row = real(cfg, mode, jobs, opts)
        if mode != "recompute":
            first = next(iter(row["outputs"]))
            row["outputs"][first] = [t + 1 for t in row["outputs"][first]]
        return row
    monkeypatch.setattr(bench_cli, "run_mode", corrupted)
    rc, report = bench(cfg_file, tmp_path, "--modes", "l1+l2+l3", "--verify", name="v2")
    out = capsys.readouterr()
    assert rc == 1
    assert report["workloads"][0]["verify"]["differs"] == {"l1+l2+l3": 1}
    assert "DIFFER from recompute: l1+l2+l3 (1 of" in out.out and "equal" not in out.out
    assert "FAIL" in out.err and "differ from recompute in l1+l2+l3" in out.err
    # the same when every mode is itself wrong but agrees with the others: never "equal"
    assert bench_cli.verify_outputs({"a": [1]}, [{"name": "l1", "outputs": {"a": [2]}},
                                                 {"name": "l1+l2", "outputs": {"a": [2]}}]) \
        == {"reference": "recompute", "requests": 1, "equal": False,
            "differs": {"l1": 1, "l1+l2": 1}, "kv": {}, "kv_corrupt": {}}


def test_a_stall_is_reported_instead_of_a_speed_up(capsys):
    def row(name, p50, **stats):
        return {"name": name, "hit_ratio": 0.5, "hit_tokens": {"l1": 1, "l2": 0, "l3": 1},
                "prompt_tokens": 4, "ttft_s": {"p50": p50, "p90": p50, "p99": p50},
                "throughput_tok_s": 1.0, "bytes": {"d2h": 0, "h2d": 0, "l3_read": 0,
                                                   "l3_write": 0},
                "gbps": {"h2d": 0.0}, "controller_us_per_request": 1.0,
                "evictions": {"l1": 0}, "stall": bench_cli.stall_summary(stats)}
    stalled = row("l1+l2+l3", 0.1, restore_fallbacks=3,
                  serving={"preemptions": 9, "blocked_steps": 300, "longest_stall": 200})
    fine = row("l1", 0.1, serving={"preemptions": 1, "blocked_steps": 1, "longest_stall": 1})
    assert stalled["stall"]["stalled"] and not fine["stall"]["stalled"]
    entry = {"trace": {}, "modes": [row("recompute", 1.0), fine, stalled],
             "ideal_hit_ratio": 0.5}
    from hicache.config import HiCacheConfig
    bench_cli._print("agentic", entry, HiCacheConfig.from_dict({}))
    text = capsys.readouterr().out
    assert "l1: TTFT p50 10.00x faster" in text
    assert "l1+l2+l3: STALLED" in text and "3 L3 restores fell back" in text
    assert "l1+l2+l3: TTFT" not in text


def test_trace_replay_soak_and_plot(cfg_file, tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [{"length": 40, "prefix_id": "sys", "prefix_len": 24, "output_len": 2}
             for _ in range(6)]
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    png = tmp_path / "b.png"
    rc, report = bench(cfg_file, tmp_path, "--trace", str(trace), "--modes", "l1,l1+l2",
                       "--duration", "2", "--plot", str(png))
    assert rc == 0
    l1 = report["modes"][0]
    assert l1["prompt_tokens"] == 6 * 40 and l1["hit_tokens"]["l1"] >= 5 * 24
    assert l1["passes"] >= 2 and l1["soak"]["leak"] is None
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, words", [
    (["--config", "/nonexistent/policy.toml"], "cannot read"),
    (["--workload", "chatty"], "unknown workload 'chatty'"),
    (["--modes", "l1,l2"], "unknown mode 'l2'"),
    (["--dcp", "3"], "parallel.dcp"),
    (["--trace", "/nonexistent/trace.jsonl"], "trace"),
    (["--scale", "0"], "--scale"),
    (["--max-running", "0"], "--max-running"),
    (["--chunk", "0"], "--chunk"),
    (["--l3-url", "http://localhost:1"], "--l3-url: 'http://localhost:1' is not a URL"),
    (["--l3-url", "redis://h:1/x"], "l3.redis.url: 'redis://h:1/x': the database must be"),
    (["--l3-url", " , "], "--l3-url: empty"),
    (["--l3-path", "/tmp/x", "--l3-url", "redis://127.0.0.1:1/0"], "--l3-path and --l3-url"),
    (["--write", "write_around"], "unknown write 'write_around'"),
    (["--max-overtakes", "x"], "--max-overtakes: 'x' is not an integer"),
    (["--max-overtakes", "-1"], "--max-overtakes must be in [0,"),
    (["--reps", "0"], "--reps must be in [1, 1000]"),
    (["--cold-l3", "--l3-url", "redis://127.0.0.1:1/0"], "--cold-l3 needs an L3 backend"),
])
def test_bad_input_is_one_line_and_exit_2(cfg_file, args, words, capsys):
    argv = ["--config", str(cfg_file), "--no-progress", *args]
    if "--config" in args:
        argv = argv[2:]
    assert bench_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_plot_without_matplotlib_is_a_clear_error(cfg_file, monkeypatch, capsys):
    real = bench_cli.importlib.util.find_spec
    monkeypatch.setattr(bench_cli.importlib.util, "find_spec",
                        lambda name: None if name == "matplotlib" else real(name))
    assert bench_cli.main(["--config", str(cfg_file), "--plot", "x.png"]) == 2
    assert "matplotlib" in capsys.readouterr().err


def test_soak_verdict_flags_leaks():
    def sample(p, rss, locks=0, req=0):
        return {"pass": p, "rss": rss, "l1_pages": 3, "l2_pages": 5, "locks": locks,
                "request_pages": req}
    flat = [sample(2, 500 << 20), sample(3, 510 << 20), sample(4, 505 << 20)]
    assert bench_cli._soak_verdict([flat])["leak"] is None
    growing = [sample(2, 500 << 20), sample(3, 700 << 20), sample(4, 900 << 20)]
    assert "resident memory grew" in bench_cli._soak_verdict([growing])["leak"]
    locked = flat[:2] + [sample(4, 505 << 20, locks=2)]
    assert "2 open locks" in bench_cli._soak_verdict([flat, locked])["leak"]


def test_write_policies_and_admission_rules_side_by_side(cfg_file, tmp_path, capsys):
    """--write and --max-overtakes give one row per combination (write policies only for modes
    with L2), every rep interleaved, timings as medians, tokens verified in every row."""
    rc, report = bench(cfg_file, tmp_path, "--modes", "l1,l1+l2", "--write",
                       "write_through,write_back", "--max-overtakes", "0,4", "--reps", "2",
                       "--verify")
    assert rc == 0
    rows = {m["name"]: m for m in report["modes"]}
    assert list(rows) == ["l1 overtake=0", "l1 overtake=4",
                          "l1+l2 write_through overtake=0", "l1+l2 write_through overtake=4",
                          "l1+l2 write_back overtake=0", "l1+l2 write_back overtake=4"]
    assert report["workloads"][0]["verify"]["equal"] is True
    for m in rows.values():
        assert len(m["reps"]) == 2
        for q in ("p50", "p90", "p99"):
            lo, hi = sorted(r["ttft_s"][q] for r in m["reps"])
            assert lo <= m["ttft_s"][q] <= hi
        assert set(m["serving_s"]) == {"admit", "step", "finish", "wait_layer", "rematch",
                                    "prefill"}
    wt, wb = rows["l1+l2 write_through overtake=4"], rows["l1+l2 write_back overtake=4"]
    assert wt["write"] == "write_through" and wb["write"] == "write_back"
    assert rows["l1 overtake=4"]["copies"]["backups"] == 0
    # write_through backs up every inserted page; write_back only what is evicted
    assert wt["copies"]["backups"] > 0 and wt["bytes"]["d2h"] > wb["bytes"]["d2h"]
    assert wt["copies"]["d2h_s"] > 0
    text = capsys.readouterr().out
    assert "l1+l2 write_back overtake=0" in text and "medians of 2 interleaved runs" in text


def test_cold_l3_starts_every_rep_on_an_empty_store(cfg_file, tmp_path):
    """Without --cold-l3 the second rep of l1+l2+l3 starts on what the first wrote (its first
    request hits L3); with it, each rep gets an empty store of its own, removed afterwards.
    (The reps compare hit ratios: L3 writes land at once, so the writer's lag behind the
    requests on a loaded machine does not move them.)"""
    with l3_writes_land_at_once():
        _check_cold_l3(cfg_file, tmp_path)


def _check_cold_l3(cfg_file, tmp_path):
    rc, warm = bench(cfg_file, tmp_path, "--modes", "l1+l2+l3", "--reps", "2", name="warm")
    assert rc == 0 and (tmp_path / "l3").exists()
    w = warm["modes"][0]["reps"]
    assert w[1]["hit_ratio"] > w[0]["hit_ratio"]
    (tmp_path / "l3").rename(tmp_path / "l3.old")  # the configured path, left alone below
    rc, cold = bench(cfg_file, tmp_path, "--modes", "l1+l2+l3", "--reps", "2", "--cold-l3",
                     name="cold")
    assert rc == 0
    c = cold["modes"][0]["reps"]
    assert c[0]["hit_ratio"] == c[1]["hit_ratio"] == w[0]["hit_ratio"]
    assert cold["modes"][0]["bytes"]["l3_write"] > 0  # L3 was on, in a store of its own
    assert not (tmp_path / "l3").exists() and not list(tmp_path.glob("l3.cold-*"))


def test_progress_bars_leave_no_semaphore_behind(tmp_path):
    """With progress on, rank 0 draws a tqdm bar; its lock must not be a named semaphore left to
    the parent's resource tracker (the ranks exit without interpreter teardown), which printed
    'leaked semaphore objects' at the end of every `make bench`."""
    import subprocess
    import sys
    cfg_file = tmp_path / "policy.toml"
    cfg_file.write_text(policy_toml(dcp=2, page_size=8))
    proc = subprocess.run([sys.executable, "-m", "hicache.commands.bench",
                           "--config", str(cfg_file),
                           "--workload", "chat", "--scale", "0.01", "--max-output", "2",
                           "--modes", "l1"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "chat:l1" in proc.stderr  # the bar was drawn
    assert "leaked semaphore" not in proc.stderr


def test_verify_reports_served_kv_that_differs_even_when_tokens_do_not(cfg_file, tmp_path,
                                                                        capsys, monkeypatch):
    """The mutation: every L1 hit page gets noise in one layer's rows as it is served (no
    checksum is involved). The tiny model's tokens may not move; --verify must fail anyway,
    naming the corrupt pages and printing the logits' difference."""
    import torch

    from hicache.service import HiCache
    real = HiCache.admit

    def admit(self, rid, tokens):
        p = real(self, rid, tokens)
        if p.device_len:
            rows = self.l1.layout.page_size
            for page in p.page_table[:p.device_len // self.page_tokens]:
                v = self.l1.layer_view(1)[page * rows:(page + 1) * rows]
                v.add_(4 * torch.randn(v.shape, generator=torch.Generator().manual_seed(page)))
        return p
    monkeypatch.setattr(HiCache, "admit", admit)
    rc, report = bench(cfg_file, tmp_path, "--modes", "recompute,l1", "--verify", name="bad")
    out = capsys.readouterr()
    v = report["workloads"][0]["verify"]
    assert rc == 1 and not v["equal"]
    c = v["kv_corrupt"]["l1"]
    assert c["bad_pages"] > 0 and c["kv_max_abs_diff"] > 0.1
    assert "verify l1: CORRUPT KV of" in out.out and "logits of" in out.out
    assert "l1 served KV that differs from recompute's" in out.err


def _l3_hits(report):
    return sum(r["hit_tokens"]["l3"] for r in report["modes"][0]["requests"])


def test_scopes_on_one_shared_l3(tmp_path, capsys):
    """--scope a, then --scope b on the same L3: b gets no L3 hit; a later --scope a run does.
    (L2 holds the whole run here, so an L3 hit can only come from an earlier run.)"""
    cfg_file = tmp_path / "policy.toml"
    cfg_file.write_text(policy_toml(tmp_path / "l3", page_size=8, l2_ratio=8.0,
                                    policy={"prefetch": "wait_complete",
                                            "l3_cost_model": False}))
    runs = {}
    for name, scope in (("a1", "a"), ("b", "b"), ("a2", "a")):
        rc, runs[name] = bench(cfg_file, tmp_path, "--modes", "l1+l2+l3", "--scope", scope,
                               name=name)
        assert rc == 0
    assert _l3_hits(runs["a1"]) == 0 and _l3_hits(runs["b"]) == 0
    assert _l3_hits(runs["a2"]) > 0
    assert list(runs["b"]["modes"][0]["scopes"]) == ["b"]
    row = runs["a2"]["modes"][0]["scopes"]["a"]
    assert row["hit_tokens"]["l3"] == _l3_hits(runs["a2"]) and row["requests"] > 0
    assert runs["a2"]["modes"][0]["outputs"] == runs["b"]["modes"][0]["outputs"]
    assert "scope a:" in capsys.readouterr().out


def test_conversations_over_scopes_and_a_public_prefix(cfg_file, tmp_path):
    rc, apart = bench(cfg_file, tmp_path, "--modes", "l1", "--scopes", "3", name="apart")
    assert rc == 0
    rc, public = bench(cfg_file, tmp_path, "--modes", "l1", "--scopes", "3", "--public-prefix",
                       name="public")
    assert rc == 0
    rc, shared = bench(cfg_file, tmp_path, "--modes", "l1", name="shared")
    a, p, s = (r["modes"][0] for r in (apart, public, shared))
    assert sorted(a["scopes"]) == ["scope-0", "scope-1", "scope-2"]
    assert sum(x["requests"] for x in a["scopes"].values()) == len(a["requests"])
    assert list(s["scopes"]) == ["(shared)"]
    # the system prompt, declared public, is prefilled once for every scope
    assert a["hit_tokens"]["l1"] < p["hit_tokens"]["l1"] <= s["hit_tokens"]["l1"]
    assert a["outputs"] == p["outputs"] == s["outputs"]


@pytest.mark.parametrize("args, words", [
    (["--scope", "a", "--scopes", "2"], "--scope and --scopes"),
    (["--scopes", "0"], "--scopes must be in [1,"),
    (["--scope", " "], "--scope: empty"),
    (["--public-prefix"], "--public-prefix: needs --scope or --scopes"),
    (["--kv-events", "localhost:5557"], "events.endpoint must be tcp://HOST:PORT"),
])
def test_bad_tenant_flags_are_one_line_and_exit_2(cfg_file, args, words, capsys):
    assert bench_cli.main(["--config", str(cfg_file), "--no-progress", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
