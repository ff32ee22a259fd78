"""hicache-bench end to end (in-process at dcp 1; the 2-rank path is covered in test_service)."""

import json

import pytest

from hicache import bench_cli

CONFIG = """
[model]
num_layers = 2
kv_lora_rank = 32
rope_dim = 8
hidden_size = 64
num_heads = 4
vocab_size = 128
[cache]
page_size = 8
[l1]
num_pages = 24
[l2]
ratio = 1.0
[l3]
enabled = true
path = "{l3}"
[policy]
prefetch = "wait_complete"
"""

MODE_KEYS = {"name", "hit_ratio", "hit_tokens", "prompt_tokens", "ttft_s", "throughput_tok_s",
             "bytes", "controller_us_per_request", "evictions"}


@pytest.fixture
def cfg_file(tmp_path):
    f = tmp_path / "policy.toml"
    f.write_text(CONFIG.format(l3=tmp_path / "l3"))
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
    assert "verify: token ids equal across modes" in text
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


def test_shared_l3_url_second_group_starts_warm(cfg_file, tmp_path, redis_url):
    """Two runs are two independent groups of processes: the second restores the first's
    pages from the shared Redis store, with the same tokens."""
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
    (["--l3-url", "http://localhost:1"], "l3.url"),
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
