"""Hybrid (Kimi Linear) prefix hits: TTFT of a prompt whose prefix hits a KDA state snapshot
over its TTFT recomputed, and the snapshot restore time over the KDA prefill it replaces, both
measured in the same run.

    python bench/hybrid.py [--json] [--quick] [--length T] [--suffix S] [--reps R]

A random Kimi Linear checkpoint (transformers' ``KimiLinearForCausalLM``, 3 KDA + 1 MLA layers,
written to a temporary directory) is served by ``hicache.serving.Server`` at DCP 1: a request
of ``T`` tokens, then ``R`` times a request of the same ``T`` tokens plus ``S`` more, once with
the cache off (recompute) and once with L1 on (a hit of ``T`` tokens: MLA KV pages plus the KDA
snapshot at ``T``). Output tokens of both runs must be equal (else exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from hicache.config import HiCacheConfig
from hicache.service import HiCache
from hicache.serving import Server
from hicache.workloads import Request

PAGE = 16


def make_checkpoint(path: str) -> None:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    cfg = KimiLinearConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128,
        q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, num_expert_group=1,
        topk_group=1, first_k_dense_replace=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 3], "full_attn_layers": [4]})
    torch.manual_seed(0)
    KimiLinearForCausalLM(cfg).eval().save_pretrained(path)


def serve(cfg: HiCacheConfig, model, mode: str, jobs: list) -> list:
    """Each job alone (its TTFT is its prefill); results in order."""
    with HiCache(cfg, mode=mode) as cache:
        server = Server(model, cache, chunk_tokens=4096, max_running=1)
        return [r for j in jobs for r in server.run([j])]


def restore_vs_kda(model, length: int, reps: int) -> tuple[float, float]:
    """Median seconds: restoring a snapshot after ``length`` tokens, and the KDA layers' share
    of prefilling those tokens (the compute a hit skips in the KDA layers)."""
    from hicache.engine.runner import DCPRunner, RequestState, reserve
    from hicache.l1 import DeviceKVPool
    from hicache.layout import DCPLayout
    from hicache.pages import PageAllocator
    c = model.cfg
    pool = DeviceKVPool(DCPLayout(1, 0, PAGE), c.num_layers, c.kv_dim, c.torch_dtype,
                        length // PAGE + 2)
    runner = DCPRunner(model, pool, backend="a2a", replicate_q=True)
    kda_s = [0.0]
    inner = runner._kda

    def timed(*args):
        t0 = time.perf_counter()
        try:
            return inner(*args)
        finally:
            kda_s[0] += time.perf_counter() - t0
    runner._kda = timed
    tokens = torch.randint(3, 1000, (length,), generator=torch.Generator().manual_seed(1))
    prefill, restore = [], []
    for _ in range(reps):
        st = RequestState()
        reserve(st, PageAllocator(pool.num_pages), length, PAGE)
        kda_s[0] = 0.0
        runner.extend(st, tokens)
        prefill.append(kda_s[0])
        snap = runner.states.snapshot(st)
        other = RequestState(page_table=list(st.page_table), length=length)
        t0 = time.perf_counter()
        runner.states.restore(other, snap)
        restore.append(time.perf_counter() - t0)
        runner.release(st)
        runner.release(other)
    return statistics.median(restore), statistics.median(prefill)


def run(length: int, suffix: int, reps: int) -> dict:
    from hicache.checkpoints.hf import load_model
    with tempfile.TemporaryDirectory() as d:
        make_checkpoint(d)
        model = load_model(d)
        cfg = HiCacheConfig.from_dict({
            "model": {"path": d, "signature": "bench-hybrid"}, "cache": {"page_size": PAGE},
            "l1": {"num_pages": 4 * (length + suffix) // PAGE + 8},
            "hybrid": {"l1_state_bytes": 64 << 20}, "policy": {"l3_cost_model": False}})
        rng = np.random.default_rng(0)
        base = rng.integers(3, 1000, length + 1)
        first = Request("first", 0, base.copy(), 1, 0)  # fed: its T+1 prompt tokens
        again = [Request(f"hit{i}", 0, np.concatenate([base, rng.integers(3, 1000, suffix)]),
                         2, i + 1) for i in range(reps)]
        ref = serve(cfg, model, "recompute", [first, *again])
        hit = serve(cfg, model, "l1", [first, *again])
        restore_s, kda_s = restore_vs_kda(model, length, reps)
    same = [r.output for r in ref] == [r.output for r in hit]
    t_ref = statistics.median(r.ttft_s for r in ref[1:])
    t_hit = statistics.median(r.ttft_s for r in hit[1:])
    return {"length": length, "suffix": suffix, "reps": reps, "cores": os.cpu_count(),
            "torch": torch.__version__, "hit_tokens": [r.hit["l1"] for r in hit[1:]],
            "ttft_recompute_s": t_ref, "ttft_hit_s": t_hit,
            "ttft_speedup": t_ref / t_hit if t_hit else 0.0,
            "restore_s": restore_s, "kda_prefill_s": kda_s,
            "restore_over_kda_prefill": restore_s / kda_s if kda_s else 0.0,
            "tokens_equal": same}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, help="prompt tokens hit, whole pages (default 2048)")
    p.add_argument("--suffix", type=int, default=16, help="new tokens after the hit")
    p.add_argument("--reps", type=int, help="requests that hit (default 5)")
    p.add_argument("--quick", action="store_true", help="defaults of 256 tokens, 3 reps")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    a.length = a.length if a.length is not None else 256 if a.quick else 2048
    a.reps = a.reps if a.reps is not None else 3 if a.quick else 5
    for name, lo in (("length", PAGE), ("suffix", 1), ("reps", 1)):
        v = getattr(a, name)
        if v < lo or (name == "length" and v % PAGE):
            print(f"error: --{name}: {v} must be >= {lo}"
                  + (f" and a multiple of {PAGE}" if name == "length" else ""), file=sys.stderr)
            return 2
    res = run(a.length, a.suffix, a.reps)
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"Kimi Linear (random, 3 KDA + 1 MLA layers), {res['length']} tokens hit + "
              f"{res['suffix']} new, {res['cores']} cores, median of {res['reps']}")
        print(f"TTFT: recompute {1e3 * res['ttft_recompute_s']:.1f} ms, snapshot hit "
              f"{1e3 * res['ttft_hit_s']:.1f} ms: {res['ttft_speedup']:.1f}x faster")
        print(f"snapshot restore {1e3 * res['restore_s']:.3f} ms over the KDA prefill it "
              f"replaces {1e3 * res['kda_prefill_s']:.1f} ms: "
              f"{res['restore_over_kda_prefill']:.4f}")
        print(f"tokens equal to recompute: {res['tokens_equal']}")
    return 0 if res["tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
