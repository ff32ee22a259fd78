"""Per-step cost of the cross-rank agreement (``StepAgreement.step``) on 2 gloo ranks.

    python bench/agreement.py [--json] [--quick] [--steps N] [--reps R]

Rows: a typical step (4 in-flight ops, 3 extras), a busy one that still fits the fixed vector's
64 payload slots, one over them (a second, agreed-size all-reduce), and debug mode (a digest of
200 entries: hashed into the vector, gathered only when ranks differ). The baseline, measured in
the same run and interleaved rep by rep, is one bare all_reduce(MIN) of the unpadded
``[6 header values + flags + extras]`` int64 list (list -> tensor -> list, no checks): what a step
costs without the fixed-size vector, the input checks and the fault slot. ``ratio`` = agreement
step time / baseline step time (medians over reps).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from hicache.distributed import launch

# name -> (in-flight ops, extras, debug)
CASES = {"typical": (4, 3, False), "busy": (40, 20, False), "over_capacity": (120, 20, False),
         "debug": (4, 3, True)}


def _rank(rank: int, world: int, steps: int, reps: int) -> dict:
    import torch
    import torch.distributed as dist

    from hicache import distributed as hd
    from hicache.controller import StepAgreement

    def bare(values):  # the baseline: one all-reduce of exactly these values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return t.tolist()

    digest = [("clock", 5, "next_op", 12)] + [(i, 2 * i, "node") for i in range(200)]
    out = {}
    for name, (n, m, debug) in CASES.items():
        ops = list(range(0, 3 * n, 3))
        done = set(ops[::2])
        extras = [7 * i + rank for i in range(m)]
        flat = [n, -n, 1, -1, m, -m] + [int(o in done) for o in ops] + extras
        agree = StepAgreement(debug=debug)
        for _ in range(20):  # warm both paths
            agree.step(ops, done, extras, digest=digest)
            bare(flat)
        with hd.CollectiveCounter.measure() as cnt:
            agree.step(ops, done, extras, digest=digest)
        times = {"agreement": [], "baseline": []}
        for _ in range(reps):
            for which in ("baseline", "agreement"):
                dist.barrier()
                t0 = time.perf_counter()
                if which == "agreement":
                    for _ in range(steps):
                        agree.step(ops, done, extras, digest=digest)
                else:
                    for _ in range(steps):
                        bare(flat)
                times[which].append((time.perf_counter() - t0) / steps * 1e6)
        a, b = statistics.median(times["agreement"]), statistics.median(times["baseline"])
        out[name] = {"ops": n, "extras": m, "debug": debug, "collectives": cnt["n"],
                     "agreement_us": round(a, 1), "baseline_us": round(b, 1),
                     "ratio": round(a / b, 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="few steps, a few seconds of work")
    ap.add_argument("--steps", type=int, default=None, help="steps per rep (default 500)")
    ap.add_argument("--reps", type=int, default=None, help="interleaved reps (default 7)")
    args = ap.parse_args()
    steps = args.steps if args.steps is not None else 50 if args.quick else 500
    reps = args.reps if args.reps is not None else 3 if args.quick else 7
    if steps < 1 or reps < 1:
        print("error: --steps and --reps must be >= 1", file=sys.stderr)
        return 2
    rows = launch(2, _rank, steps, reps, backend="gloo", timeout_s=300)[0]
    out = {"benchmark": "agreement", "ranks": 2, "steps": steps, "reps": reps,
           "load": os.getloadavg()[0], "machine": platform.machine(),
           "results": [{"case": k, **v} for k, v in rows.items()]}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"2 gloo ranks, {steps} steps x {reps} reps, load {out['load']:.1f}")
        print(f"{'case':<14}{'ops':>5}{'extras':>7}{'colls':>6}{'agree us':>10}"
              f"{'bare us':>9}{'ratio':>7}")
        for r in out["results"]:
            print(f"{r['case']:<14}{r['ops']:>5}{r['extras']:>7}{r['collectives']:>6}"
                  f"{r['agreement_us']:>10.1f}{r['baseline_us']:>9.1f}{r['ratio']:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
