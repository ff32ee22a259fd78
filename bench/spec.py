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
from hicache.commands.decode import DecodeSpec, build_model, decode_worker, decode_worker_many


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
    ap.add_argument("--cache", action="store_true",
                    help="also: the draft's pages through L1/L2/L3 (one rank, HiCache)")
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
    if args.cache:
        out["cache"] = cache_rows(prompt_len, new_tokens, max(ks))
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
        if args.cache:
            print_cache(out["cache"], prompt_len)
    ok = all(r["tokens_match"] for r in rows) and all(
        r["tokens_ok"] for r in out.get("cache", {}).get("rows", []))
    return 0 if ok else 1


# ---- --cache: the draft's pages through the tiers (one rank) --------------------------------
def _request(cache, model, draft, rid, prompt, k, new_tokens, spec=True):
    """One request through the cache (the README's loop with a draft): its figures."""
    import numpy as np
    from hicache.checkpoints.drafter import drafter_for
    from hicache.engine.runner import DCPRunner, RequestState
    from hicache.engine.spec import SpecStats, speculative_generate
    import time
    p = cache.admit(rid, prompt)
    while not p.ready:
        cache.step()
    cache.alloc(rid, len(prompt) + new_tokens)
    runner = DCPRunner(model, cache.kv, layer_hook=lambda i: cache.wait_layer(rid, i))
    state = RequestState(page_table=p.page_table, length=p.hit_len)
    logits = runner.extend(state, torch.as_tensor(prompt[p.hit_len:]))
    st = SpecStats()
    if not spec:  # a writer without speculation: no draft pages
        out = [int(logits[-1].argmax())]
        for _ in range(new_tokens - 1):
            out.append(int(runner.extend(state, [out[-1]])[-1].argmax()))
        cache.finish(rid, np.concatenate([prompt, out[:-1]]))
        return {"request": rid, "tokens": out}
    d = drafter_for(draft, cache.page_tokens, p.page_table, cache.l1.num_pages,
                    pool=cache.draft.kv)
    st.draft_recomputed_tokens = d.restored(p.draft_len, p.hit_len)
    t0 = time.perf_counter()
    out = speculative_generate(runner, state, list(prompt), logits[-1], d, k, new_tokens,
                               hidden=runner.last_hidden, stats=st)
    wall = time.perf_counter() - t0
    cache.finish(rid, np.concatenate([prompt, out[:-1]]), draft_len=d.valid_len())
    return {"request": rid, "hit": {"l1": p.device_len, "l2": p.host_len, "l3": p.storage_len},
            "draft_restored": p.draft_len, "draft_recomputed_tokens": st.draft_recomputed_tokens,
            "draft_prefill_ms": st.draft_prefill_s * 1e3, "decode_ms": wall * 1e3,
            "tokens_per_target_step": st.to_dict()["tokens_per_target_step"], "tokens": out}


def cache_rows(prompt_len: int, new_tokens: int, k: int) -> dict:
    """A speculative request written, then hit from L1, from L3 after a warm restart, and a
    prefix written without speculation hit by a speculative request (draft recomputed)."""
    import numpy as np
    from hicache import HiCache, load_config
    from hicache.checkpoints.drafter import draft_spec
    from hicache.engine.model import MLAModel
    from hicache.serving import model_config
    from hicache.paths import default_policy
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(default_policy()).replace(parallel={"tp": 1, "dcp": 1},
                                                    l3={"path": tmp})
        model = MLAModel(model_config(cfg))
        draft = MLAModel(model_config(cfg))  # draft = target: every proposal accepted
        ds = draft_spec(draft, cfg.page_tokens)
        rng = np.random.default_rng(0)
        shared = rng.integers(0, cfg.model.vocab_size, prompt_len)
        ask = [np.concatenate([shared, rng.integers(0, cfg.model.vocab_size, 8)])
               for _ in range(5)]
        rows = []
        with HiCache(cfg, weights_signature=model.weights_signature(), draft=ds) as cache:
            rows.append(_request(cache, model, draft, "write", ask[0], k, new_tokens))
            rows.append(_request(cache, model, draft, "l1 hit", ask[1], k, new_tokens))
            cache.drain()
            tiers = cache.stats()["draft"]
        with HiCache(cfg, weights_signature=model.weights_signature(), draft=ds) as cache:
            rows.append(_request(cache, model, draft, "l3 hit (restart)", ask[2], k,
                                 new_tokens))
            tiers_l3 = cache.stats()["draft"]
        other = cfg.replace(l3={"path": tmp + "-plain"})
        with HiCache(other, weights_signature=model.weights_signature(), draft=ds) as cache:
            _request(cache, model, draft, "plain", ask[3], k, new_tokens, spec=False)
            rows.append(_request(cache, model, draft, "l1 hit, no draft", ask[4], k,
                                 new_tokens))
    for r, p in zip(rows, [ask[0], ask[1], ask[2], ask[4]]):
        r["tokens_ok"] = r.pop("tokens") == model.generate(p.tolist(), new_tokens)
    return {"rows": rows, "draft_bytes_by_tier": tiers["bytes"],
            "draft_bytes_l3_read_after_restart": tiers_l3["bytes"]["l3_read"],
            "draft_page_bytes": ds.format.page_bytes}


def print_cache(out: dict, prompt_len: int) -> None:
    print(f"\ndraft pages through the tiers: prompts sharing {prompt_len} tokens, dcp 1, "
          f"draft = target, {out['draft_page_bytes']:,} draft bytes a page")
    hdr = (f"{'request':<18} {'hit l1/l2/l3':>14} {'draft restored':>14} "
           f"{'draft recomp':>12} {'draft prefill ms':>16} {'tok/step':>8} {'tokens ok':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in out["rows"]:
        h = r["hit"]
        print(f"{r['request']:<18} {h['l1']:>4}/{h['l2']}/{h['l3']:<6} "
              f"{r['draft_restored']:>14} {r['draft_recomputed_tokens']:>12} "
              f"{r['draft_prefill_ms']:>16.2f} {r['tokens_per_target_step']:>8.2f} "
              f"{str(r['tokens_ok']):>9}")
    b = out["draft_bytes_by_tier"]
    print(f"draft bytes: L1->L2 {b['d2h']:,}, L2->L1 {b['h2d']:,}, L3 written {b['l3_write']:,}"
          f" (once for the group), L3 read after restart "
          f"{out['draft_bytes_l3_read_after_restart']:,}")


if __name__ == "__main__":
    sys.exit(main())
