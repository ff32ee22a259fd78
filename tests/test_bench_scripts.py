"""The speed benchmarks in bench/ run and print the documented JSON (quick sizes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run(script, *args):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick", "--json", *args],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_transfer_benchmark_json():
    out = run("transfer.py", "--dcp", "2", "--pattern", "contiguous")
    rows = out["results"]
    assert {(r["layout"], r["direction"]) for r in rows} == {
        (l, d) for l in ("page_first", "layer_first") for d in ("d2h", "h2d")}
    for r in rows:
        assert {"layout", "direction", "dcp", "bytes", "gbps", "memcpy_gbps", "ratio",
                "cpu_ratio"} <= set(r)
        assert r["dcp"] == 2 and r["bytes"] > 0 and r["gbps"] > 0 and r["cpu_ratio"] > 0
        assert abs(r["ratio"] - r["gbps"] / r["memcpy_gbps"]) < 0.01


def test_copy_overhead_benchmark_json():
    out = run("copy_overhead.py", "--shapes", "chat", "--pages", "1", "3")
    rows = out["rows"]
    assert {(r["layout"], r["direction"], r["pages"]) for r in rows} == {
        (l, d, n) for l in ("page_first", "layer_first") for d in ("d2h", "h2d") for n in (1, 3)}
    for r in rows:
        assert r["job_us"] > 0 and r["raw_us"] > 0 and r["bytes"] == r["pages"] * 4 * 16 * 80 * 4
        assert abs(r["ratio"] - r["job_us"] / r["raw_us"]) < 0.01
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "copy_overhead.py"), "--pages", "0"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "--pages: 0 is outside" in r.stderr


def test_controller_benchmark_json():
    out = run("controller.py")
    assert out["ample_hits_identical"] is True  # same hit tokens as both reference trees
    assert out["min_page_speedup"] > 0
    for r in out["rows"]:
        assert r["us_per_request"] > 0 and r["ref_us_per_request"] > 0
        assert r["page_ref_us_per_request"] > 0
        assert abs(r["page_speedup"] - r["page_ref_us_per_request"] / r["us_per_request"]) < 1e-6
        if r["capacity"] == "ample":
            assert r["hit_tokens"] == r["ref_hit_tokens"] == r["page_ref_hit_tokens"]
            assert r["identical_hits"]
        if r["capacity"] == "budget+l2":  # the page-keyed reference runs the same host tier
            assert r["hit_l2"] > 0 and r["hit_tokens"] == r["page_ref_hit_tokens"]
    assert out["hits_identical"] is True


def test_controller_benchmark_replays_a_production_trace(tmp_path):
    lines = []
    for i in range(60):  # conversations: every third request continues the one before it
        ids = [0] + [1000 * (i - 1) + k for k in range(1, 4)] + [1000 * i + 9] if i % 3 == 2 \
            else [0] + [1000 * i + k for k in range(1, 4)]
        lines.append(json.dumps({"timestamp": 100 * i, "input_length": 512 * len(ids) - 3,
                                 "output_length": 10, "hash_ids": ids}))
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    out = run("controller.py", "--trace", str(trace), "--block-tokens", "16", "--inflight",
              "1", "--capacities", "ample", "budget")
    rows = out["rows"]
    assert {(r["workload"], r["page"], r["capacity"]) for r in rows} == {
        ("trace", 16, "ample"), ("trace", 16, "budget")}
    ample = next(r for r in rows if r["capacity"] == "ample")
    # the shared block (all but the first), and the continued requests' parent's 4 blocks
    assert ample["hit_tokens"] == 16 * (39 + 4 * 20) == ample["page_ref_hit_tokens"]
    assert out["hits_identical"] is True and ample["requests"] == 60


def test_controller_benchmark_refs_sglang_needs_sglang():
    """``--refs sglang`` runs no in-process reference, so without SGLang there is nothing to
    compare: one line naming why, exit 2 (and for a host tier SGLang's trees do not run)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "controller.py"), "--quick",
                        "--refs", "sglang", "--capacities", "ample", "--sglang",
                        str(ROOT / "no-such-python")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "--refs sglang, but SGLang cannot run" in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "controller.py"), "--quick",
                        "--refs", "sglang"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "--capacities ample and/or budget" in r.stderr


def test_l3_benchmark_json_with_redis(redis_server):
    out = run("l3.py", "--pages", "6", "--repeats", "1", "--url", redis_server.url)
    assert out["backend"] == "both" and len(out["per_rank"]) == 2
    for r in out["per_rank"]:
        for k in ("put_ratio", "get_ratio", "redis_put_ratio", "redis_get_ratio",
                  "redis_vs_lmdb_get"):
            assert r[k] > 0, k
        assert abs(r["redis_get_ratio"] - r["redis_get_gbs"] / r["redis_raw_get_gbs"]) < 0.01


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs every check")
def test_gpu_check_says_there_is_no_gpu_and_exits_0():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no GPU here" in r.stdout


def test_l3_fleet_benchmark_json():
    out = run("l3.py", "--fleet", "2", "--fleet-sequences", "2", "--fleet-shared", "2",
              "--fleet-pages", "2")
    one, wide = out["one"], out["wide"]
    assert out["bench"] == "l3-fleet" and one["processes"] == 1 and wide["processes"] == 2
    for r in (one, wide):
        assert r["wrong"] == 0 and r["corrupt"] == 0 and r["errors"] == 0
        assert r["put_gbs"] > 0 and r["get_gbs"] > 0 and r["get_p99_ms"] >= r["get_p50_ms"]
        assert r["pages_written"] == r["unique_pages"]  # shared pages stored once
    assert wide["dedup_skipped"] == 2 * 2  # the second process's copy of the shared pages
    assert abs(out["get_ratio"] - wide["get_gbs"] / one["get_gbs"]) < 1e-9


def test_l3_dead_shard_benchmark_json():
    out = run("l3.py", "--dead-shard", "3", "--prefixes", "30", "--prefix-pages", "8")
    assert out["shards"] == 3 and 0 < out["kept_mean_pages"] < 8
    assert out["model_spread_pages"] < out["model_colocated_pages"]


def test_spec_serving_benchmark_json():
    """bench/spec_serving.py: the chat workload served plainly and with a draft (batched), at
    DCP 2: TPOT ratio against the plain row of the same run, tokens per target step,
    acceptance by draft KV source, tokens equal to plain decoding's."""
    out = run("spec_serving.py", "--dcp", "2", "--noise", "0")
    rows = out["rows"]
    assert [(r["dcp"], r["spec"]) for r in rows] == [(2, "none"), (2, "draft")]
    plain, spec = rows
    assert plain["tpot_ratio"] == 1.0 and plain["tokens_per_target_step"] == 1.0
    assert abs(spec["tpot_ratio"] * plain["tpot_ms"] - spec["tpot_ms"]) < 1e-6 * spec["tpot_ms"]
    assert spec["acceptance_rate"] == 1.0 and spec["tokens_per_target_step"] > 1.5  # = target
    assert sum(spec["source_requests"].values()) == spec["requests"] == plain["requests"] > 1
    assert all(r["tokens_ok"] for r in rows) and spec["flagged"] == []


def test_mtp_batch_benchmark_json():
    out = run("mtp_batch.py", "--requests", "1,3")
    assert [r["requests"] for r in out["rows"]] == [1, 3]
    for r in out["rows"]:
        assert r["same_tokens"] is True and r["batched_ms"] > 0
        assert abs(r["ratio"] - r["one_at_a_time_ms"] / r["batched_ms"]) < 1e-6
        assert (r["one_at_a_time_steps"], r["batched_steps"]) == (3 * r["requests"], 3)
