"""Batched speculative serving: the chat workload with a draft against plain decoding, per DCP size.

    python bench/spec_serving.py [--json] [--quick] [--dcp 1,2] [--k 3] [--noise 0.1]
                                 [--scale 0.05] [--max-output 24] [--workload chat]

For each DCP size, ``hicache-bench --spec none,draft --verify`` serves the workload with the
example policy's built-in model (l1+l2+l3, an empty L3 store per run) plainly and with a draft
model that is the target plus seeded noise (``--noise``: relative to each tensor's spread;
written to a temporary file), k draft tokens per request per round, every running request
verified in one target step. A row: TPOT p50 and its ratio to the plain row of the same run
(below 1: faster), the decode-only TPOT (the decode steps' wall time per token, without other
requests' prefills between a request's tokens) and its ratio, tokens per target step, acceptance overall and by where each request's
draft KV came from (cold, L1, L2, L3, recomputed), and whether every request's tokens equal
plain decoding's.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import sys
import tempfile
from contextlib import redirect_stdout

import torch

from hicache.commands import bench as bench_cli
from hicache.commands.bench_model import engine_model
from hicache.config import load_config
from hicache.commands.report import table


def write_draft(path: str, noise: float, seed: int = 3) -> None:
    """The example policy's built-in model plus seeded noise, saved as a model file."""
    model = engine_model(load_config(str(bench_cli.EXAMPLE)), seed=0)
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    draft.save(path)


def run_dcp(c: int, args, draft: str, tmp: str) -> dict:
    """``hicache-bench --spec none,draft`` at DCP ``c``: its JSON report."""
    out = os.path.join(tmp, f"spec-dcp{c}.json")
    argv = ["--spec", "none,draft", "--draft-model", draft, "--dcp", str(c),
            "--workload", args.workload, "--scale", str(args.scale),
            "--max-output", str(args.max_output), "--num-draft-tokens", str(args.k),
            "--l3-path", os.path.join(tmp, f"l3-{c}"), "--verify", "--no-progress",
            "--out", out]
    with redirect_stdout(io.StringIO()):
        rc = bench_cli.main(argv)
    if rc != 0:
        raise SystemExit(f"hicache-bench --spec at dcp {c} exited {rc}")
    with open(out) as f:
        return json.load(f)


def rows_of(c: int, report: dict) -> list[dict]:
    out = []
    for e in report["workloads"]:
        for r in e["rows"]:
            sp = r["speculative"] or {}
            out.append({"dcp": c, "workload": e["workload"], "mode": r["mode"],
                        "spec": r["spec"], "k": r["k"], "requests": r["requests"],
                        "tpot_ms": r["tpot_s"]["p50"] * 1e3, "tpot_ratio": r["tpot_ratio"],
                        "decode_ms_per_token": r["tpot_s"]["decode_p50"] * 1e3,
                        "decode_ratio": r["decode_tpot_ratio"],
                        "tokens_per_target_step": sp.get("tokens_per_target_step", 1.0),
                        "acceptance_rate": sp.get("acceptance_rate"),
                        "by_source": {s: b["acceptance_rate"]
                                      for s, b in sp.get("by_source", {}).items()},
                        "source_requests": {s: b["requests"]
                                            for s, b in sp.get("by_source", {}).items()},
                        "flagged": sp.get("flagged", []), "tokens_ok": r["tokens_match"]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="a tiny workload, seconds of work")
    ap.add_argument("--dcp", default="1,2", help="comma-separated DCP sizes")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per request per round")
    ap.add_argument("--noise", type=float, default=0.1, help="the draft's noise (0: = target)")
    ap.add_argument("--scale", type=float, default=None, help="workload scale")
    ap.add_argument("--max-output", type=int, default=None, help="tokens per request, at most")
    ap.add_argument("--workload", default="chat")
    args = ap.parse_args(argv)
    args.scale = args.scale or (0.005 if args.quick else 0.05)
    args.max_output = args.max_output or (9 if args.quick else 24)
    torch.set_num_threads(1)  # DCP 1 runs in this process: one thread, like each gloo rank
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        draft = os.path.join(tmp, "draft.pt")
        write_draft(draft, args.noise)
        for c in [int(x) for x in args.dcp.split(",")]:
            rows += rows_of(c, run_dcp(c, args, draft, tmp))
    report = {"benchmark": "spec_serving", "k": args.k, "noise": args.noise,
              "scale": args.scale, "max_output": args.max_output, "cpus": os.cpu_count(),
              "rows": rows}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"batched speculative serving: {args.workload} x{args.scale}, <= {args.max_output} "
          f"tokens per request, k {args.k}, draft = target + noise {args.noise}")
    print(table([[r["dcp"], r["spec"], r["requests"], f"{r['tpot_ms']:.2f}",
                  f"{r['tpot_ratio']:.2f}", f"{r['decode_ms_per_token']:.2f}",
                  f"{r['decode_ratio']:.2f}", f"{r['tokens_per_target_step']:.2f}",
                  "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}",
                  " ".join(f"{s} {a:.2f}({r['source_requests'][s]})"
                           for s, a in r["by_source"].items()) or "-",
                  ",".join(r["flagged"]) or "-", r["tokens_ok"]] for r in rows],
                ["dcp", "spec", "requests", "TPOT ms", "x plain", "decode ms/tok", "x plain",
                 "tok/step", "accept",
                 "accept by source (requests)", "flagged", "tokens ok"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
