"""The fleet model (``hicache.fleet_model``) and ``hicache plan --fleet``: bytes per token per
rank from the topology registry, L3 bytes per request, store GB/s per node and fleet, the hit
ratio above which the store bounds TTFT, and what a prefix keeps with one shard of N dead
(checked against a simulation of uniformly placed pages)."""

import json
import random
import subprocess
import sys

import pytest

from hicache.errors import UsageError
from hicache.fleet_model import (FleetInputs, kept_colocated, kept_spread, max_nodes, plan,
                                 shared_process_gbs, store_bound_hit_ratio)
from hicache.topology import get_model

DSV3 = get_model("deepseek-v3")
ROW = 61 * (512 + 64) * 2  # one token's latent KV, all layers, bf16


@pytest.mark.parametrize("model", ["deepseek-v3", "deepseek-r1", "kimi-k2"])
def test_bytes_per_request_and_bandwidth_by_hand(model):
    f = FleetInputs(get_model(model), tp=8, dcp=8, prompt_tokens=1000, hit_ratio=0.75,
                    requests_per_s=2.0, nodes=10, prefill_tokens_per_s=10000.0,
                    process_gbs=0.5, store_gbs=20.0)
    p = plan(f)
    assert p.bytes_per_token_per_rank == ROW / 8
    assert p.read_bytes_per_request_per_rank == 750 * ROW / 8
    assert p.read_bytes_per_request_per_node == 750 * ROW  # 8 ranks, one shard each
    assert p.write_bytes_per_request_per_node == 250 * ROW  # each new page once per shard
    assert p.node_gbs == pytest.approx(2.0 * 1000 * ROW / 1e9)
    assert p.aggregate_gbs == pytest.approx(10 * p.node_gbs)
    assert p.load_s == pytest.approx(750 * ROW / 8 / 0.5e9)
    assert p.compute_s == pytest.approx(0.025)
    assert p.store_bound == (p.load_s > p.compute_s)
    assert p.max_nodes == pytest.approx(20.0 / p.node_gbs)


def test_without_dcp_every_rank_reads_the_whole_latent():
    p1, p8 = (plan(FleetInputs(DSV3, tp=8, dcp=d, hit_ratio=1.0)) for d in (1, 8))
    assert p1.bytes_per_token_per_rank == ROW and p8.bytes_per_token_per_rank == ROW / 8
    assert p1.read_bytes_per_request_per_node == 8 * p8.read_bytes_per_request_per_node
    assert p1.load_s == pytest.approx(8 * p8.load_s)


def test_the_store_bounds_ttft_exactly_above_the_threshold_hit_ratio():
    h = store_bound_hit_ratio(ROW / 8, 20000.0, 1.0)
    below, above = (plan(FleetInputs(DSV3, 8, 8, hit_ratio=x, prefill_tokens_per_s=20000.0,
                                     process_gbs=1.0)) for x in (h - 0.01, h + 0.01))
    assert not below.store_bound and above.store_bound
    at = plan(FleetInputs(DSV3, 8, 8, hit_ratio=h, prefill_tokens_per_s=20000.0))
    assert at.load_s == pytest.approx(at.compute_s)
    assert max_nodes(0.0, 10.0) == float("inf") and max_nodes(2.0, 0.0) == float("inf")


def test_processes_share_the_store_once_it_saturates():
    assert shared_process_gbs(1.0, 4, 0.0) == 1.0
    assert shared_process_gbs(1.0, 2, 3.0) == 1.0
    assert shared_process_gbs(1.0, 8, 4.0) == 0.5
    with pytest.raises(UsageError):
        shared_process_gbs(1.0, 0)


@pytest.mark.parametrize("shards,pages", [(3, 32), (6, 16), (2, 4)])
def test_what_a_prefix_keeps_matches_a_simulation(shards, pages):
    rng = random.Random(shards * 100 + pages)
    trials = 20000
    kept = 0
    for _ in range(trials):  # pages on uniform shards; shard 0 dead
        for i in range(pages):
            if rng.randrange(shards) == 0:
                break
            kept += 1
    assert kept / trials == pytest.approx(kept_spread(pages, shards), rel=0.05)
    assert kept_colocated(pages, shards) == pytest.approx(pages * (shards - 1) / shards)
    assert kept_spread(pages, shards) < kept_colocated(pages, shards)


def test_bad_fleet_inputs_are_refused():
    for kw in ({"hit_ratio": 1.5}, {"nodes": 0}, {"requests_per_s": 0.0},
               {"store_gbs": -1.0}, {"dcp": 3}):
        with pytest.raises(Exception) as e:
            FleetInputs(DSV3, **{"tp": 8, "dcp": 8, **kw})
        assert isinstance(e.value, (UsageError, ValueError))


def _plan(*argv):
    return subprocess.run([sys.executable, "-m", "hicache.commands.cli", "plan", "--fleet", *argv],
                          capture_output=True, text=True, timeout=120)


def test_plan_fleet_prints_the_model_as_table_and_json():
    r = _plan("--model", "kimi-k2", "--tp", "8", "--dcp", "8", "--hit-ratio", "0.6",
              "--rate", "2", "--nodes", "16", "--store-gbs", "40", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    f = out["fleet"]
    assert out["dcp"] == 8 and f["bytes_per_token_per_rank"] == ROW / 8
    assert f["aggregate_gbs"] == pytest.approx(16 * f["node_gbs"])
    assert f["max_nodes"] == pytest.approx(40 / f["node_gbs"])
    r = _plan("--model", "deepseek-r1", "--tp", "8", "--dcp", "8")
    assert r.returncode == 0 and "store bounds TTFT above hit ratio" in r.stdout
    assert "nodes the store serves" in r.stdout and "unbounded" in r.stdout
    for argv in (["--hit-ratio", "2"], ["--dcp", "3"], ["--nodes", "0"]):
        r = _plan("--model", "deepseek-v3", "--tp", "8", *argv)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
