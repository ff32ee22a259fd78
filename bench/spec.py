"""Speculative decoding beside DCP: decode wall time per output token with speculation over without.

    python bench/spec.py [--json] [--quick] [--dcp 1,2] [--k 1,3] [--new-tokens N]

The built-in seeded model decodes one seeded prompt greedily, plainly and with a draft model
identical to the target (``--spec draft``, saved to a temporary file), for each DCP size and k.
Every row is measured in the same run; the ratio is speculative TPOT over plain TPOT of the same
DCP size (below 1: faster). With draft = target every proposal is accepted, so tokens per target
step is k + 1 (short of it only in the last round). The draft's KV is replicated: its bytes per
rank do not shrink with c, the target's do. Tokens are checked equal to plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import warnings

import torch

from hicache.distributed import launch
from hicache.decode_cli import DecodeSpec, build_model, decode_worker, decode_worker_many


def model_overrides(quick: bool) -> tuple:
    if quick:
        return (("num_layers", 2),)
    return (("num_layers", 4), ("kv_lora_rank", 128), ("qk_rope_head_dim", 32),
            ("hidden_size", 128), ("num_heads", 8))


def tpot(res: dict) -> float:
    """Decode wall time per output token of one rank's result."""
    steps = res["step_times"]
    sp = res.get("speculative")
    if sp is None:
        return statistics.mean(steps)  # one token per plain step
    return sum(steps) / (sp["tokens_per_target_step"] * sp["target_steps"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="small sizes, a few seconds of work")
    ap.add_argument("--dcp", default="1,2", help="comma-separated DCP sizes")
    ap.add_argument("--k", default="1,3", help="comma-separated draft lengths (1..8)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    torch.set_num_threads(1)  # like each gloo rank
    prompt_len = args.prompt_len or (64 if args.quick else 512)
    new_tokens = args.new_tokens or (9 if args.quick else 33)
    sizes = [int(x) for x in args.dcp.split(",")]
    ks = [int(x) for x in args.k.split(",")]
    base = dict(prompt_len=prompt_len, new_tokens=new_tokens, seed=0, page_size=16,
                model_overrides=model_overrides(args.quick), warmup_steps=3, attn_backend="torch")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        draft = os.path.join(tmp, "draft.pt")
        build_model(DecodeSpec(**base)).save(draft)  # draft = target
        for c in sizes:
            specs = [DecodeSpec(dcp=c, **base)] + [
                DecodeSpec(dcp=c, spec="draft", draft_model=draft, num_draft_tokens=k, **base)
                for k in ks]
            if c == 1:
                results = [[decode_worker(0, 1, s)] for s in specs]
            else:
                per_rank = launch(c, decode_worker_many, specs, backend="gloo", timeout_s=900)
                results = [[per_rank[r][i] for r in range(c)] for i in range(len(specs))]
            plain = max(tpot(r) for r in results[0])
            for spec, res in zip(specs, results):
                t = max(tpot(r) for r in res)  # the group moves at its slowest rank
                sp = res[0].get("speculative")
                rows.append({
                    "dcp": c, "spec": spec.spec,
                    "k": spec.num_draft_tokens if spec.spec != "none" else None,
                    "tpot_s": t, "tpot_ratio": t / plain,
                    "tokens_per_target_step": sp["tokens_per_target_step"] if sp else 1.0,
                    "acceptance_rate": sp["acceptance_rate"] if sp else None,
                    "target_kv_bytes_per_rank": max(r["kv_bytes"] for r in res),
                    "draft_kv_bytes_per_rank": max(r.get("draft_kv_bytes", 0) for r in res),
                    "tokens_match": res[0]["tokens"] == results[0][0]["tokens"],
                })
    out = {"benchmark": "spec", "prompt_len": prompt_len, "new_tokens": new_tokens,
           "model": dict(base["model_overrides"]), "draft": "identical to the target",
           "baseline": "plain greedy decode of the same DCP size, same run", "rows": rows,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "python": platform.python_version()}}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"speculative decode: prompt {prompt_len}, {new_tokens} new, model {out['model']}, "
              "draft = target, gloo CPU processes")
        hdr = (f"{'dcp':>3} {'spec':>5} {'k':>2} {'TPOT ms':>8} {'x plain':>7} "
               f"{'tok/step':>8} {'accept':>6} {'target KV B/rank':>16} "
               f"{'draft KV B/rank':>15} {'tokens ok':>9}")
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
            print(f"{r['dcp']:>3} {r['spec']:>5} {r['k'] or '-':>2} {r['tpot_s'] * 1e3:>8.2f} "
                  f"{r['tpot_ratio']:>7.2f} {r['tokens_per_target_step']:>8.2f} {acc:>6} "
                  f"{r['target_kv_bytes_per_rank']:>16,} {r['draft_kv_bytes_per_rank']:>15,} "
                  f"{str(r['tokens_match']):>9}")
    return 0 if all(r["tokens_match"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
