"""PCP prefill benchmark: prefill time for N = 1, 2, 4 ranks (ratio to N = 1, measured in the same
run) for both attention modes, and the causal work per rank (DualChunkSwap vs a contiguous split).

    python bench/prefill.py [--json] [--quick] [--length T] [--sizes 1,2,4] [--modes full_kv,ring]

Every rank is a CPU gloo process with one torch thread (``hicache.distributed.launch``), so the
speed-up is bounded by the machine's free cores; the table prints the core count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from tqdm import tqdm

from hicache.distributed import launch
from hicache.engine.model import MLAModel, ModelConfig
from hicache.pcp.partition import DualChunkSwap, contiguous_work_per_rank
from hicache.pcp.prefill import pcp_prefill

MODEL = dict(vocab_size=1024, hidden_size=256, num_layers=2, num_heads=16, kv_lora_rank=128,
             qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, intermediate_size=512)


def bench_worker(rank: int, world: int, length: int, mode: str, repeats: int) -> dict:
    """One rank: warm up, then time ``repeats`` prefills (a barrier before each)."""
    import torch.distributed as dist
    model = MLAModel(ModelConfig(**MODEL))
    tokens = torch.randint(0, MODEL["vocab_size"], (length,),
                           generator=torch.Generator().manual_seed(7))
    pcp_prefill(model, tokens[: max(8 * world, length // 8)], mode=mode)  # warm-up
    times = []
    res = None
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        res = pcp_prefill(model, tokens, mode=mode)
        times.append(time.perf_counter() - t0)
    return {"times": times, "pairs": res.pairs_computed // MODEL["num_layers"],
            "work": res.partition.causal_work(rank), "argmax": int(res.last_logits.argmax())}


def run(length: int, sizes: list[int], modes: list[str], repeats: int) -> dict:
    rows: list[dict] = []
    jobs = [(n, m) for n in sizes for m in modes]  # both modes measured close in time
    for n, mode in tqdm(jobs, desc="prefill", file=sys.stderr, disable=not sys.stderr.isatty()):
        out = launch(n, bench_worker, length, mode, repeats, backend="gloo", timeout_s=600)
        # a prefill ends when its slowest rank ends: max over ranks per repeat, then median
        per_repeat = [max(r["times"][i] for r in out) for i in range(repeats)]
        rows.append({"mode": mode, "pcp": n, "time_s": statistics.median(per_repeat),
                     "rank_time_s": [statistics.median(r["times"]) for r in out],
                     "pairs_per_rank": [r["pairs"] for r in out],
                     "causal_work_per_rank": [r["work"] for r in out],
                     "argmax": out[0]["argmax"]})
    for row in rows:
        base = next(r for r in rows if r["mode"] == row["mode"] and r["pcp"] == min(sizes))
        row["speedup_vs_n1"] = base["time_s"] / row["time_s"]
    balance = []
    for n in sorted(set(sizes) | {8}):
        for t in (length, 131_072):
            part = DualChunkSwap(t, n)
            work = part.work_per_rank()
            naive = contiguous_work_per_rank(t, n)
            balance.append({"length": t, "pcp": n, "dcs_max_over_mean": max(work) / (sum(work) / n),
                            "contiguous_max_over_mean": max(naive) / (sum(naive) / n),
                            "dcs_work_per_rank": work})
    return {"length": length, "model": MODEL, "cores": os.cpu_count(), "repeats": repeats,
            "torch": torch.__version__, "rows": rows, "balance": balance,
            "same_last_token": len({r["argmax"] for r in rows}) == 1}


def print_table(res: dict) -> None:
    print(f"PCP prefill, {res['length']} tokens, {res['model']['num_layers']} layers, "
          f"{res['cores']} CPU cores, one torch thread per rank, median of {res['repeats']}")
    print(f"{'mode':8} {'N':>2} {'time s':>8} {'x vs N=1':>9} {'rank times s':>28} "
          f"{'scored pairs / causal work per rank':>40}")
    for r in res["rows"]:
        rt = " ".join(f"{t:.3f}" for t in r["rank_time_s"])
        eff = " ".join(f"{p / max(1, w):.2f}" for p, w in zip(r["pairs_per_rank"],
                                                               r["causal_work_per_rank"]))
        print(f"{r['mode']:8} {r['pcp']:>2} {r['time_s']:8.3f} {r['speedup_vs_n1']:9.2f} "
              f"{rt:>28} {eff:>40}")
    print("causal work balance (max / mean per rank): DualChunkSwap vs contiguous chunks")
    for b in res["balance"]:
        print(f"  T={b['length']:>7} N={b['pcp']}: DCS {b['dcs_max_over_mean']:.4f}   "
              f"contiguous {b['contiguous_max_over_mean']:.4f}")
    print(f"same last-token argmax in every run: {res['same_last_token']}")
    print("note: each rank scores its chunks against every earlier key (the diagonal chunk "
          "masked: scored/causal = 1 + 1/(2N)) and skips keys wholly in the causal future; N=1 "
          "is the same code on one rank. Ranks share the machine's cores.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="short prompt, one repeat")
    ap.add_argument("--length", type=int, default=None, help="prompt tokens (default 1024)")
    ap.add_argument("--sizes", default="1,2,4", help="PCP sizes, comma separated")
    ap.add_argument("--modes", default="full_kv,ring", help="attention modes, comma separated")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    length = args.length or (512 if args.quick else 1024)
    repeats = args.repeats or (1 if args.quick else 3)
    sizes = [int(x) for x in args.sizes.split(",")]
    modes = args.modes.split(",")
    res = run(length, sizes, modes, repeats)
    if args.json:
        print(json.dumps(res))
    else:
        print_table(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
