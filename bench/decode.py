"""Decode step time and per-rank KV bytes of DCP decode for c = 1, 2, 4 and each merge backend.

    python bench/decode.py [--json] [--quick] [--prompt-len N] [--new-tokens K]
    python bench/decode.py --kernel [--json] [--quick]     # CUDA: Triton kernel vs torch path

Every configuration decodes the same seeded prompt greedily (tokens are checked equal across
configurations). Ratios are against c = 1 measured in the same run. On CPU the ranks are gloo
processes, so the step time shows the collectives' cost; KV bytes per rank show the 1/c saving.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import warnings

import torch
from tqdm import tqdm

from hicache.distributed import launch
from hicache.commands.decode import DecodeSpec, decode_worker, decode_worker_many

VARIANTS = [("a2a", True), ("a2a", False), ("ag_rs", True), ("ag_rs", False)]


def model_overrides(quick: bool) -> tuple:
    if quick:
        return (("num_layers", 2),)
    # a bit closer to a real MLA row shape (512 + 64), scaled down
    return (("num_layers", 4), ("kv_lora_rank", 128), ("qk_rope_head_dim", 32),
            ("hidden_size", 128), ("num_heads", 8))


def kernel_bench(quick: bool, as_json: bool) -> int:
    """Latent decode attention: Triton kernel against the torch path on one GPU (bf16 rows)."""
    from hicache.engine.attention import attend_latent
    if not torch.cuda.is_available():
        msg = "kernel benchmark needs CUDA; none here (the CPU tests cover correctness)"
        print(json.dumps({"benchmark": "decode_kernel", "skipped": msg}) if as_json else msg)
        return 0
    dev = torch.device("cuda")
    r, dr, heads = 512, 64, 16  # DeepSeek-style latent row; 16 heads per rank (TP=8 of 128)
    rows = []
    lengths = [4096, 16384] if quick else [4096, 16384, 65536, 131072]
    for n in tqdm(lengths, desc="kernel", disable=as_json, file=sys.stderr):
        for t in (1, 4):
            g = torch.Generator(device=dev).manual_seed(n + t)
            q_lat = torch.randn(t, heads, r, device=dev, generator=g)
            q_pe = torch.randn(t, heads, dr, device=dev, generator=g)
            kv = torch.randn(n, r + dr, device=dev, generator=g).to(torch.bfloat16)
            pos = torch.arange(n, device=dev)
            q_pos = torch.arange(n - t, n, device=dev)
            res = {}
            for backend in ("torch", "triton"):
                fn = lambda: attend_latent(q_lat, q_pe, kv, q_pos, pos, 0.07, r,  # noqa: E731
                                           backend=backend)
                out = fn()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                iters = 20
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                torch.cuda.synchronize()
                res[backend] = (start.elapsed_time(end) / iters / 1e3, out)
            err = float((res["torch"][1][0] - res["triton"][1][0]).abs().max())
            rows.append({"kv_len": n, "queries": t, "torch_s": res["torch"][0],
                         "triton_s": res["triton"][0],
                         "speedup": res["torch"][0] / res["triton"][0], "max_abs_err": err,
                         "kv_gb_s": n * (r + dr) * 2 / res["triton"][0] / 1e9})
    out = {"benchmark": "decode_kernel", "device": torch.cuda.get_device_name(dev),
           "heads": heads, "kv_lora_rank": r, "rope_dim": dr, "rows": rows}
    if as_json:
        print(json.dumps(out))
    else:
        print(f"latent decode attention on {out['device']} (bf16 rows, {heads} heads, R={r})")
        print(f"{'kv_len':>8} {'q':>2} {'torch us':>10} {'triton us':>10} {'speedup':>8} "
              f"{'GB/s':>8} {'max err':>9}")
        for x in rows:
            print(f"{x['kv_len']:>8} {x['queries']:>2} {x['torch_s'] * 1e6:>10.1f} "
                  f"{x['triton_s'] * 1e6:>10.1f} {x['speedup']:>8.2f} {x['kv_gb_s']:>8.1f} "
                  f"{x['max_abs_err']:>9.2e}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="small sizes, a few seconds of work")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--dcp", default="1,2,4", help="comma-separated DCP sizes")
    ap.add_argument("--kernel", action="store_true",
                    help="time the Triton latent attention kernel against torch (needs CUDA)")
    args = ap.parse_args(argv)
    if args.kernel:
        return kernel_bench(args.quick, args.json)
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # the spawned ranks too
    torch.set_num_threads(1)  # like each gloo rank, so c = 1 is a fair baseline
    prompt_len = args.prompt_len or (256 if args.quick else 2048)
    new_tokens = args.new_tokens or (8 if args.quick else 24)
    sizes = [int(x) for x in args.dcp.split(",")]
    if sizes[0] != 1:
        sizes = [1] + sizes
    base = dict(prompt_len=prompt_len, new_tokens=new_tokens, seed=0, page_size=16,
                model_overrides=model_overrides(args.quick), warmup_steps=3, attn_backend="torch")

    rows = []
    for c in tqdm(sizes, desc="dcp sizes", disable=args.json, file=sys.stderr):
        if c == 1:
            specs = [DecodeSpec(dcp=1, **base)]
            results = [[decode_worker(0, 1, specs[0])]]
        else:
            specs = [DecodeSpec(dcp=c, backend=b, replicate_q=rq, **base) for b, rq in VARIANTS]
            per_rank = launch(c, decode_worker_many, specs, backend="gloo", timeout_s=900)
            results = [[per_rank[r][i] for r in range(c)] for i in range(len(specs))]
        for spec, res in zip(specs, results):
            steps = [statistics.median(r["step_times"]) for r in res]
            rows.append({
                "dcp": c,
                "backend": "plain" if c == 1 else spec.backend,
                "replicate_q": spec.replicate_q if c > 1 else None,
                "step_time_s": max(steps),  # the group moves at its slowest rank
                "kv_bytes_per_rank": [r["kv_bytes"] for r in res],
                "kv_rows_per_rank": [r["kv_rows"] for r in res],
                "collectives_per_layer": res[0]["collectives_per_layer"],
                "tokens": res[0]["tokens"],
            })
    base_row = rows[0]
    for r in rows:
        r["step_time_ratio"] = r["step_time_s"] / base_row["step_time_s"]
        r["kv_bytes_ratio"] = max(r["kv_bytes_per_rank"]) / base_row["kv_bytes_per_rank"][0]
        r["tokens_match"] = r["tokens"] == base_row["tokens"]
    out = {
        "benchmark": "decode",
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "model": dict(base["model_overrides"]),
        "baseline": "dcp=1 (plain path, no collective), same run",
        "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"decode: prompt {prompt_len} tokens, {new_tokens} new, model {out['model']}, "
              "gloo CPU processes")
        hdr = (f"{'dcp':>3} {'backend':>7} {'repl_q':>6} {'step ms':>9} {'x c=1':>6} "
               f"{'KV B/rank (max)':>16} {'x c=1':>6} {'coll/layer':>10} {'tokens ok':>9}")
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            rq = "-" if r["replicate_q"] is None else ("yes" if r["replicate_q"] else "no")
            print(f"{r['dcp']:>3} {r['backend']:>7} {rq:>6} {r['step_time_s'] * 1e3:>9.2f} "
                  f"{r['step_time_ratio']:>6.2f} {max(r['kv_bytes_per_rank']):>16,} "
                  f"{r['kv_bytes_ratio']:>6.3f} {r['collectives_per_layer']:>10g} "
                  f"{str(r['tokens_match']):>9}")
    return 0 if all(r["tokens_match"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
