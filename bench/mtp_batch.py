"""MTP drafting batched across requests against one request at a time (``propose_batch``).

    python bench/mtp_batch.py [--json] [--quick] [--requests 1,4,8] [--k 3] [--prompt 64]
                              [--reps 5]

The example policy's built-in model as the target, with one MTP module (seeded weights: what
is timed is the drafting, not what it accepts) on a replicated runner shared by every request,
as the serving loop has it. For each batch size n: n requests prefill their prompts (the
target's hidden states fed to their modules), then propose k draft tokens each, batched (k
module steps for the batch) and one request at a time (n * k steps), from the same state (set
up again before each rep, outside the timing); best of --reps. Both must propose the same
tokens. Prints milliseconds per round, the ratio (one at a time over batched) and the module
steps each ran (``extend_batch`` calls: n * k against k).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from hicache.commands import bench as bench_cli
from hicache.commands.bench_model import engine_model
from hicache.commands.report import table
from hicache.config import load_config
from hicache.engine.mtp import MTPModule
from hicache.engine.runner import DCPRunner, RequestState, reserve
from hicache.engine.spec import MTPDrafter, propose_batch, replicated_runner
from hicache.l1 import DeviceKVPool
from hicache.layout import DCPLayout
from hicache.pages import PageAllocator


def mtp_module(target, seed: int = 1) -> MTPModule:
    """An MTP module for ``target``'s config, seeded (norms at 1, the rest small)."""
    mtp = MTPModule(target.cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mtp.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return mtp


@torch.no_grad()
def drafters(target, mtp, n: int, prompt: int, k: int, page: int) -> tuple:
    """n requests prefilled on the target, each with an MTP drafter on one shared runner."""
    cfg = target.cfg
    pages = n * (-(-(prompt + k + 2) // page)) + 1
    pool = DeviceKVPool(DCPLayout(1, 0, page), cfg.num_layers, cfg.kv_dim, cfg.torch_dtype,
                        pages)
    runner = DCPRunner(target, pool, attn_backend="torch")
    module = replicated_runner(mtp, page, pages, "torch")
    alloc = PageAllocator(pages)
    g = torch.Generator().manual_seed(n)
    out, seqs = [], []
    for _ in range(n):
        toks = torch.randint(0, cfg.vocab_size, (prompt,), generator=g).tolist()
        st = RequestState()
        reserve(st, alloc, prompt + k + 2, page)
        last = runner.extend(st, toks)[-1]
        d = MTPDrafter(module, st.page_table)
        d.observe(runner.last_hidden, 0, prompt)
        seq = toks + [int(last.argmax())]
        d.catch_up(seq)  # the prefill's part: the round proposes from the last position
        out.append(d)
        seqs.append(seq)
    return out, seqs


def time_round(target, mtp, n: int, args, batched: bool) -> tuple[float, list, int]:
    """(best seconds of a round, its proposals, module steps it ran)."""
    best, got, steps = float("inf"), None, []
    for _ in range(args.reps):
        ds, seqs = drafters(target, mtp, n, args.prompt, args.k, args.page)
        run = ds[0].runner
        extend = run.extend_batch
        steps.clear()
        run.extend_batch = lambda *a, **kw: steps.append(1) or extend(*a, **kw)
        t0 = time.perf_counter()
        if batched:
            got = propose_batch(ds, seqs, [args.k] * n)
        else:
            got = [d.propose(s, args.k) for d, s in zip(ds, seqs)]
        best = min(best, time.perf_counter() - t0)
    return best, got, len(steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    ap.add_argument("--requests", default=None, help="comma-separated batch sizes")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per request")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--reps", type=int, default=5, help="repetitions; the best counts")
    args = ap.parse_args(argv)
    if args.k < 1 or args.prompt < 1 or args.reps < 1:
        ap.error("--k, --prompt and --reps must be at least 1")
    sizes = [int(x) for x in (args.requests or ("1,4" if args.quick else "1,4,8")).split(",")]
    if args.quick:
        args.reps, args.prompt = 2, min(args.prompt, 16)
    torch.set_num_threads(1)
    cfg = load_config(str(bench_cli.EXAMPLE))
    target = engine_model(cfg, seed=0)
    mtp = mtp_module(target)
    args.page = cfg.page_tokens  # the widened page (P * dcp)
    rows = []
    for n in sizes:
        one, a, one_steps = time_round(target, mtp, n, args, batched=False)
        batch, b, batch_steps = time_round(target, mtp, n, args, batched=True)
        rows.append({"requests": n, "k": args.k, "one_at_a_time_ms": one * 1e3,
                     "batched_ms": batch * 1e3, "ratio": one / batch, "same_tokens": a == b,
                     "one_at_a_time_steps": one_steps, "batched_steps": batch_steps})
    report = {"benchmark": "mtp_batch", "prompt": args.prompt, "reps": args.reps,
              "cpus": os.cpu_count(), "rows": rows}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"MTP drafting, k {args.k}, prompts of {args.prompt} tokens, best of {args.reps}")
        print(table([[r["requests"], f"{r['one_at_a_time_ms']:.2f}", f"{r['batched_ms']:.2f}",
                      f"{r['ratio']:.2f}x", r["one_at_a_time_steps"], r["batched_steps"],
                      r["same_tokens"]] for r in rows],
                    ["requests", "one at a time ms", "batched ms", "ratio", "steps one at a time",
                     "steps batched", "same tokens"]))
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
