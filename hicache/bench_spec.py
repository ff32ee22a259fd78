"""``hicache-bench --spec none,mtp|draft``: speculative decoding rows side by side.

Each method in ``--spec`` decodes the same seeded prompt greedily on the policy's DCP group
(``hicache.decode_cli.decode_worker``: gloo processes, one launch for every method); a row gets
the decode wall time per output token (TPOT), its ratio to the ``none`` row of the same run, and
the ``"speculative"`` object of ``hicache decode --json`` (``proposed``, ``accepted``,
``acceptance_rate``, ``mean_accepted_len``, ``target_steps``, ``tokens_per_target_step``,
``draft_recomputed_tokens``), plus the target's and the draft's KV bytes per rank and whether the
tokens equal plain decoding's (they must: the bench exits 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from .config import HiCacheConfig
from .errors import UsageError
from .report import table

PROMPT_LEN = 256
WARMUP_STEPS = 2
METHODS = ("none", "mtp", "draft")

__all__ = ["add_spec_options", "spec_requested", "spec_main", "spec_rows"]


def add_spec_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (rows side by side, docs/speculative.md)")
    g.add_argument("--spec", default=None, metavar="M[,M...]",
                   help="comma-separated, any of none, mtp, draft: decode the same prompt with "
                        "each and print TPOT and the speculative columns side by side")
    g.add_argument("--draft-model", default=None, metavar="DIR",
                   help="--spec draft: the draft checkpoint directory or model file")
    g.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help="draft tokens k per target step (1..8; default: the policy's [spec])")


def spec_requested(args) -> bool:
    """``--spec`` given; its companions without it are a usage error."""
    if args.spec is None:
        if args.draft_model is not None or args.num_draft_tokens is not None:
            raise UsageError("--draft-model / --num-draft-tokens need --spec")
        return False
    return True


def _methods(args) -> list[str]:
    names = [n.strip() for n in args.spec.split(",") if n.strip()]
    if not names:
        raise UsageError("--spec: give at least one of none, mtp, draft")
    for n in names:
        if n not in METHODS:
            raise UsageError(f"--spec: unknown method {n!r}; expected any of "
                             f"{', '.join(METHODS)}")
    if len(set(names)) != len(names):
        raise UsageError(f"--spec: a method repeats in {args.spec!r}")
    if "mtp" in names and not args.model:
        raise UsageError("--spec mtp needs --model DIR (a checkpoint with MTP tensors)")
    if "draft" in names and not args.draft_model:
        raise UsageError("--spec draft needs --draft-model DIR")
    if args.draft_model and "draft" not in names:
        raise UsageError("--draft-model is given but --spec has no 'draft'")
    return names


def _specs(args, cfg: HiCacheConfig, names: list[str]) -> list:
    from .decode_cli import DecodeSpec
    from .engine.spec import SpecSettings
    from .cli import number
    from .serving import model_config
    number("--max-output", args.max_output, 1, 4096)
    k = args.num_draft_tokens if args.num_draft_tokens is not None else cfg.spec.num_draft_tokens
    m = model_config(cfg, seed=args.seed)
    over = () if args.model else tuple(
        (f, getattr(m, f)) for f in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                                     "kv_lora_rank", "qk_rope_head_dim", "intermediate_size",
                                     "dtype"))
    out = []
    for n in names:
        draft = args.draft_model if n == "draft" else None
        SpecSettings(n, draft or "", k)  # k out of range: one line, before any rank starts
        out.append(DecodeSpec(dcp=cfg.parallel.dcp, prompt_len=PROMPT_LEN,
                              new_tokens=args.max_output, seed=args.seed,
                              page_size=cfg.cache.page_size, model_path=args.model,
                              model_overrides=over, warmup_steps=WARMUP_STEPS,
                              spec=n, draft_model=draft, num_draft_tokens=k))
    return out


def _tpot(res: dict) -> float:
    """Decode wall time per output token of one rank's result."""
    steps, sp = res["step_times"], res.get("speculative")
    if sp is None:
        return statistics.mean(steps)
    return sum(steps) / max(1.0, sp["tokens_per_target_step"] * sp["target_steps"])


def spec_rows(specs: list, results: list[list[dict]]) -> list[dict]:
    """One row per method (``results[i]``: every rank's result of ``specs[i]``)."""
    plain = next((r for s, r in zip(specs, results) if s.spec == "none"), results[0])
    base_t, base_tokens = max(_tpot(r) for r in plain), plain[0]["tokens"]
    rows = []
    for s, res in zip(specs, results):
        t = max(_tpot(r) for r in res)  # the group moves at its slowest rank
        rows.append({"spec": s.spec, "k": s.num_draft_tokens if s.spec != "none" else None,
                     "tpot_s": t, "tpot_ratio": t / base_t if base_t else 0.0,
                     "speculative": res[0].get("speculative"),
                     "target_kv_bytes_per_rank": max(r["kv_bytes"] for r in res),
                     "draft_kv_bytes_per_rank": max(r.get("draft_kv_bytes", 0) for r in res),
                     "tokens_match": all(r["tokens"] == base_tokens for r in res)})
    return rows


def _print(rows: list[dict], dcp: int) -> None:
    print(f"speculative decoding: prompt {PROMPT_LEN}, dcp {dcp} "
          "(TPOT ratio: over the 'none' row of this run)")
    head = ["spec", "k", "TPOT ms", "x none", "proposed", "accepted", "accept", "mean acc",
            "target steps", "tok/step", "draft recomp", "draft KV B/rank", "tokens ok"]
    body = []
    for r in rows:
        sp = r["speculative"] or {}
        body.append([r["spec"], r["k"] or "-", f"{r['tpot_s'] * 1e3:.2f}",
                     f"{r['tpot_ratio']:.2f}", sp.get("proposed", "-"),
                     sp.get("accepted", "-"),
                     f"{sp['acceptance_rate']:.2f}" if sp else "-",
                     f"{sp['mean_accepted_len']:.2f}" if sp else "-",
                     sp.get("target_steps", "-"),
                     f"{sp['tokens_per_target_step']:.2f}" if sp else "1.00",
                     sp.get("draft_recomputed_tokens", "-"),
                     r["draft_kv_bytes_per_rank"], r["tokens_match"]])
    print(table(body, head))


def spec_main(args, cfg: HiCacheConfig) -> int:
    """Run every ``--spec`` method, print the table (or the JSON), 1 when tokens differ."""
    from .decode_cli import decode_worker, decode_worker_many
    from .distributed import launch
    specs = _specs(args, cfg, _methods(args))
    c = cfg.parallel.dcp
    if c == 1:
        results = [[decode_worker(0, 1, s)] for s in specs]
    else:
        per_rank = launch(c, decode_worker_many, specs, backend="gloo", timeout_s=900)
        results = [[per_rank[r][i] for r in range(c)] for i in range(len(specs))]
    rows = spec_rows(specs, results)
    report = {"benchmark": "spec", "dcp": c, "prompt_len": PROMPT_LEN,
              "new_tokens": args.max_output, "model": args.model or "built-in",
              "rows": rows}
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        print(text)
    else:
        _print(rows, c)
    bad = [r["spec"] for r in rows if not r["tokens_match"]]
    for name in bad:
        print(f"FAIL --spec {name}: tokens differ from plain decoding", file=sys.stderr)
    return 1 if bad else 0
