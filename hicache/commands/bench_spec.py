"""``hicache-bench --spec none,mtp|draft``: the cache workloads served with speculative decoding.

Each method in ``--spec`` serves the same workload (chat, agentic, or a trace) through the
batched serving loop (``hicache.serving.Server`` with ``hicache.serving.spec``: every running
request drafts k tokens, the batch verifies in one target step per round) on the policy's DCP
group, in the deepest cache mode the policy has (``l1+l2+l3`` with L3 on, else ``l1+l2``; or
``--modes``). Per mode and method a row gives TPOT (per request: time from its first to its
last token over its tokens after the first; the p50 over requests) and the decode-only TPOT
(the wall time of the decode steps a request was in, over the same tokens: without the
prefills of other requests between its tokens), each with its ratio to the ``none`` row of
the same mode, and the JSON ``"speculative"`` object: ``requests``,
``tokens_per_target_step``, ``acceptance_rate``, ``draft_recomputed_tokens`` and ``by_source``
(acceptance of the requests by where their draft KV came from: ``cold``, ``l1``, ``l2``,
``l3``, ``recomputed``). A source whose acceptance is below the cold requests' by more than
``SOURCE_MARGIN`` is flagged (``flagged``; "LOW" in the table): restored draft state that
drafts worse than recomputed state is wrong. ``--verify``: every request's tokens must equal
plain decoding's (the ``none`` row, run for the purpose when not asked), else exit 1. The
single-prompt comparison is ``hicache decode --spec`` (``bench/spec.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ..config import HiCacheConfig
from ..errors import UsageError
from .report import table

METHODS = ("none", "mtp", "draft")
SOURCE_MARGIN = 0.1  # acceptance below the cold requests' by more than this is flagged

__all__ = ["add_spec_options", "spec_requested", "spec_main", "spec_summary", "rank_spec",
           "SOURCE_MARGIN"]


def add_spec_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding, batched (docs/speculative.md)")
    g.add_argument("--spec", default=None, metavar="M[,M...]",
                   help="comma-separated, any of none, mtp, draft: serve the workloads with "
                        "each (batched: every running request drafts, one target step per "
                        "round) and print TPOT, tokens per target step and acceptance by "
                        "draft KV source side by side")
    g.add_argument("--draft-model", default=None, metavar="DIR",
                   help="--spec draft: the draft checkpoint directory or model file")
    g.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help="draft tokens k per request per round (1..8; default: the policy's "
                        "[spec])")


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


# ---- in each rank -------------------------------------------------------------------------------
def rank_spec(cfg: HiCacheConfig, model, opts: dict) -> tuple:
    """(the ``DraftSpec`` a ``HiCache`` keeps the draft's pages under, the ``SpecServing`` of
    the ``Server``) for ``opts["spec"]``; ``(None, None)`` for none."""
    method = opts.get("spec") or "none"
    if method == "none":
        return None, None
    from ..checkpoints.drafter import draft_spec, load_draft
    from ..engine.spec import SpecSettings
    from ..serving.spec import SpecServing
    settings = SpecSettings(method, opts.get("draft_model") or "", opts["num_draft_tokens"])
    draft = load_draft(settings, model, cfg.model.path)
    return draft_spec(draft, cfg.page_tokens), SpecServing(draft, settings.num_draft_tokens)


# ---- the figures ----------------------------------------------------------------------------------
def _rate(accepted: int, proposed: int) -> float:
    return accepted / proposed if proposed else 0.0


def spec_summary(per_request: list[dict], margin: float = SOURCE_MARGIN) -> dict:
    """The ``"speculative"`` object of one row from its requests' ``Result.spec`` dicts."""
    from ..serving.spec import SOURCES
    by: dict = {}
    for r in per_request:
        b = by.setdefault(r["source"], {"requests": 0, "proposed": 0, "accepted": 0})
        b["requests"] += 1
        b["proposed"] += r["proposed"]
        b["accepted"] += r["accepted"]
    by = {s: dict(by[s], acceptance_rate=_rate(by[s]["accepted"], by[s]["proposed"]))
          for s in SOURCES if s in by}
    cold = by.get("cold", {}).get("acceptance_rate")
    flagged = [s for s, b in by.items() if s != "cold" and cold is not None and b["proposed"]
               and b["acceptance_rate"] < cold - margin]
    steps = sum(r["target_steps"] for r in per_request)
    proposed = sum(r["proposed"] for r in per_request)
    return {"requests": len(per_request),
            "tokens_per_target_step": sum(r["emitted"] for r in per_request) / steps
            if steps else 0.0,
            "acceptance_rate": _rate(sum(r["accepted"] for r in per_request), proposed),
            "proposed": proposed, "target_steps": steps,
            "draft_recomputed_tokens": sum(r["draft_recomputed_tokens"] for r in per_request),
            "by_source": by, "margin": margin, "flagged": flagged}


def spec_row(method: str, k, row: dict, base: dict | None) -> dict:
    """A mode's summary row (``bench_cli.summarize``) as a ``--spec`` row."""
    def ratio(key):
        b = base["tpot_s"][key] if base else 0.0
        return row["tpot_s"][key] / b if b else None
    return {"name": f"{row['name']} {method}", "mode": row["name"], "spec": method,
            "k": k if method != "none" else None, "requests": len(row["outputs"]),
            "tpot_s": row["tpot_s"], "tpot_ratio": ratio("p50"),
            "decode_tpot_ratio": ratio("decode_p50"),
            "ttft_s": row["ttft_s"], "hit_ratio": row["hit_ratio"],
            "speculative": row.get("speculative"), "outputs": row["outputs"]}


# ---- the command ---------------------------------------------------------------------------------
def _modes(args, cfg: HiCacheConfig) -> list[str]:
    from ..service import CACHE_MODES
    if args.modes != ",".join(CACHE_MODES):  # given on the command line
        from .bench import _names
        return _names("--modes", args.modes, CACHE_MODES)
    return ["l1+l2+l3" if cfg.l3.enabled else "l1+l2"]


def _runs(args, cfg: HiCacheConfig, names: list[str]) -> tuple[list, list, int]:
    """(workloads, modes, k) after every check, before any rank starts."""
    from .bench import WORKLOADS, _names
    from ..engine.spec import SpecSettings
    k = args.num_draft_tokens if args.num_draft_tokens is not None else cfg.spec.num_draft_tokens
    for n in names:  # k out of range: one line, before any rank starts
        SpecSettings(n, args.draft_model if n == "draft" else "", k)
    workloads = [Path(args.trace).stem] if args.trace else \
        _names("--workload", args.workload, WORKLOADS)
    return workloads, _modes(args, cfg), k


def spec_main(args, cfg: HiCacheConfig) -> int:
    """Serve every workload with each ``--spec`` method; the table (or JSON); exit 1 when
    ``--verify`` finds a request whose tokens differ from plain decoding's."""
    from .bench import _cold_l3, _jobs, run_mode
    from ..service import CACHE_MODES
    names = _methods(args)
    workloads, modes, k = _runs(args, cfg, names)
    report = {"benchmark": "spec", "dcp": cfg.parallel.dcp, "k": k,
              "model": args.model or "built-in", "workloads": []}
    failed = []
    for w in workloads:
        jobs = _jobs(args, w, cfg)
        entry = {"workload": w, "rows": []}
        for mode in modes:
            want = names if "none" in names or not args.verify else ["none"] + names
            runs = {}
            for n in want:  # each on an empty L3 store of its own: the methods start alike
                opts = {"seed": args.seed, "backend": args.backend, "chunk": args.chunk,
                        "max_running": args.max_running, "progress": not args.no_progress,
                        "duration": 0.0, "workload": f"{w}:{n}", "metrics_port": None,
                        "verify": False, "spec": n, "draft_model": args.draft_model,
                        "num_draft_tokens": k}
                with _cold_l3(cfg, "l3" in CACHE_MODES[mode]) as c:
                    runs[n] = run_mode(c, mode, jobs, opts)
            rows = [spec_row(n, k, runs[n], runs.get("none")) for n in want]
            failed += _verify(args, w, rows)
            entry["rows"] += [r for r in rows if r["spec"] in names]
        report["workloads"].append(entry)
    _emit(args, report)
    for f in failed:
        print(f"FAIL {f}", file=sys.stderr)
    return 1 if failed else 0


def _verify(args, workload: str, rows: list[dict]) -> list[str]:
    """Each row's tokens against the same mode's ``none`` row (``tokens_match``); with
    ``--verify`` the rows that differ are failures."""
    base = next((r for r in rows if r["spec"] == "none"), None)
    out = []
    for r in rows:
        if base is None:
            r["tokens_match"] = None
            continue
        bad = sum(1 for key in base["outputs"] if r["outputs"].get(key) != base["outputs"][key])
        r["tokens_match"] = bad == 0
        if bad and args.verify:
            out.append(f"{workload}: {r['name']}: token ids of {bad} of {len(base['outputs'])} "
                       "requests differ from plain decoding")
    return out


def _emit(args, report: dict) -> None:
    for e in report["workloads"]:
        for r in e["rows"]:
            r.pop("outputs", None)
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        print(text)
        return
    for e in report["workloads"]:
        _print(e, report)


def _sources(sp: dict | None) -> str:
    if not sp:
        return "-"
    return " ".join(f"{s} {b['acceptance_rate']:.2f}({b['requests']})"
                    + (" LOW" if s in sp["flagged"] else "") for s, b in sp["by_source"].items())


def _print(entry: dict, report: dict) -> None:
    print(f"\n== {entry['workload']}: speculative serving, dcp {report['dcp']}, k "
          f"{report['k']} (TPOT: p50 over requests; decode: its decode steps only; x none: "
          "over the none row of the same mode; acceptance by draft KV source, LOW: below "
          f"cold by > {SOURCE_MARGIN})")
    body = []
    for r in entry["rows"]:
        sp = r["speculative"]
        body.append([r["mode"], r["spec"], r["requests"], f"{r['tpot_s']['p50'] * 1e3:.2f}",
                     f"{r['tpot_ratio']:.2f}" if r["tpot_ratio"] else "-",
                     f"{r['tpot_s']['decode_p50'] * 1e3:.2f}",
                     f"{r['decode_tpot_ratio']:.2f}" if r["decode_tpot_ratio"] else "-",
                     f"{sp['tokens_per_target_step']:.2f}" if sp else "1.00",
                     f"{sp['acceptance_rate']:.2f}" if sp else "-",
                     sp["draft_recomputed_tokens"] if sp else "-", _sources(sp),
                     "-" if r["tokens_match"] is None else r["tokens_match"]])
    print(table(body, ["mode", "spec", "requests", "TPOT ms", "x none", "decode ms/tok",
                       "x none", "tok/step", "accept",
                       "draft recomp", "accept by source (requests)", "tokens ok"]))
    flagged = [(r["name"], s) for r in entry["rows"] if r["speculative"]
               for s in r["speculative"]["flagged"]]
    for name, s in flagged:
        print(f"  {name}: requests whose draft KV came from {s} accept less than cold ones: "
              "restored draft state may be wrong")


def tpot_summary(res: list) -> dict:
    """p50 / p90 of the requests' TPOT (those with more than one token), and the p50 of
    their decode-only TPOT (``decode_p50``: the decode steps' wall time per token, without
    the prefills of other requests that ran between their tokens)."""
    many = [r for r in res if len(r[2]) > 1]
    t = np.array([r[5] for r in many] or [0.0])
    d = np.array([r[7] for r in many] or [0.0])
    return {"p50": float(np.percentile(t, 50)), "p90": float(np.percentile(t, 90)),
            "decode_p50": float(np.percentile(d, 50))}
