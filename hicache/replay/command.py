"""``hicache replay TRACE``: the command line (options, capacities, table, JSON, plot)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from .. import topology
from ..config import PolicySection, default
from ..controller.policy import EVICTION_POLICIES, WRITE_POLICIES
from ..errors import ConfigError
from ..commands.report import table
from ..workloads.traces import FORMATS, load
from .offline import ideal_hits, next_uses, reference_hits
from .sim import TIERS, ReplayResult, ReplaySettings, replay
from .sizes import parse_size, parse_sizes

COST_MODEL = ("deepseek-v3", 8, 1)  # bytes per token for the TTFT estimate without --model


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a production trace through the cache controller "
                                      "(no model): hit ratio per tier, ideal, reference")
    p.add_argument("trace", help="trace file (JSON lines)")
    p.add_argument("--trace-format", required=True, choices=FORMATS)
    p.add_argument("--block-tokens", type=int, help="tokens per hash id (default: the "
                   "format's own, mooncake 512, bailian 16)")
    p.add_argument("--page-tokens", type=int, help="tokens per cache page (default: one block)")
    for tier, size in (("l1", "100%"), ("l2", "0"), ("l3", "0")):
        p.add_argument(f"--{tier}", default=size, metavar="SIZE",
                       help=f"{tier.upper()} capacity: tokens, bytes with a unit (KB..TB, needs "
                            f"--model) or N%% of the trace's unique pages; 0 turns it off "
                            f"(default {size.replace('%', '%%')})")
    p.add_argument("--eviction", choices=EVICTION_POLICIES,
                   default=default(PolicySection, "eviction"))
    p.add_argument("--write", choices=WRITE_POLICIES, default=default(PolicySection, "write"))
    p.add_argument("--capacities", metavar="SIZES",
                   help="sweep the L1 capacity over these comma-separated sizes")
    p.add_argument("--compare", metavar="ORDERS",
                   help="replay these comma-separated eviction orders (e.g. lru,learned) at "
                        "each capacity of --capacities (else at --l1) and show them side by "
                        "side, each against the first")
    p.add_argument("--max-requests", type=int, help="replay only the first N requests")
    p.add_argument("--model", help=f"bytes per token for sizes in bytes and the TTFT estimate: "
                                   f"one of {', '.join(sorted(topology.MODELS))}")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--prefill-tok-s", type=float, default=10000.0,
                   help="prefill speed (tokens/s): how long a request prefills")
    p.add_argument("--decode-ms", type=float, default=20.0, help="milliseconds per decoded token")
    p.add_argument("--plot", help="hit ratio against capacity (with --capacities; matplotlib)")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=main)


def _bytes_per_token(args) -> tuple[float | None, float]:
    """(bytes per token for sizes in bytes (None without --model), for the cost model)."""
    if args.model is None:
        shape = topology.get_model(COST_MODEL[0])
        return None, topology.kv_bytes_per_token(shape, COST_MODEL[1], COST_MODEL[2])
    shape = topology.get_model(args.model)
    topology.validate(args.tp, args.dcp, shape.num_kv_heads)
    bpt = topology.kv_bytes_per_token(shape, args.tp, args.dcp)
    return bpt, bpt


def settings(args, trace) -> tuple[ReplaySettings, list[int] | None]:
    """The replay's settings and the L1 sweep (pages) from the command line."""
    page = trace.block_tokens if args.page_tokens is None else args.page_tokens
    if page < 1 or page > 1 << 16:
        raise ConfigError(f"--page-tokens must be in [1, 65536], got {page}")
    for flag, v in (("--prefill-tok-s", args.prefill_tok_s), ("--decode-ms", args.decode_ms)):
        if not 0 < v < 1e12:
            raise ConfigError(f"{flag} must be > 0, got {v}")
    size_bpt, cost_bpt = _bytes_per_token(args)
    unique = _unique_tokens(trace, page)
    kw = dict(bytes_per_token=size_bpt, unique_tokens=unique)
    pages = {t: parse_size(getattr(args, t), f"--{t}", **kw) // page for t in TIERS}
    sweep = None
    if args.capacities is not None:
        sweep = [c // page for c in parse_sizes(args.capacities, "--capacities", **kw)]
    s = ReplaySettings(page, pages["l1"], pages["l2"], pages["l3"], args.eviction, args.write,
                       bytes_per_token=cost_bpt, prefill_tokens_per_s=args.prefill_tok_s,
                       decode_s_per_token=args.decode_ms / 1e3)
    return s, sweep


def _unique_tokens(trace, page: int) -> int:
    """Tokens in the trace's unique pages (what ``N%`` sizes are shares of)."""
    if trace.requests[0].hash_ids is not None and page == trace.block_tokens:
        return trace.unique_blocks() * page
    from .keys import page_keys
    keys: set[int] = set()
    for r in trace.requests:
        keys.update(page_keys(r.tokens(), page))
    return len(keys) * page


class _Runs:
    """Replays of one trace, each (eviction order, L1 size) once, as report rows. The offline
    figures depend only on the trace's page keys: the ideal and the next uses are computed
    once, the reference once per capacity."""

    def __init__(self, trace, progress: bool) -> None:
        self.trace, self.progress = trace, progress
        self.rows: dict = {}
        self.refs: dict = {}  # capacity (pages, all tiers) -> reference hit tokens
        self.ideal = self.uses = None

    def row(self, s: ReplaySettings) -> dict:
        key = (s.eviction, s.l1_pages)
        if key not in self.rows:
            res = replay(self.trace, s, progress=self.progress)
            if self.uses is None:
                self.ideal, self.uses = ideal_hits(res.keys), next_uses(res.keys)
            cap = s.l1_pages + s.l2_pages + s.l3_pages
            if cap not in self.refs:
                self.refs[cap] = reference_hits(res.keys, cap, self.uses)
            self.rows[key] = _row(res, s, self.ideal, self.refs[cap])
        return self.rows[key]


def _row(res: ReplayResult, s: ReplaySettings, ideal: int, reference: int) -> dict:
    pt = res.prompt_tokens or 1
    return {
        "requests": res.requests, "prompt_tokens": res.prompt_tokens,
        "capacity_pages": {"l1": s.l1_pages, "l2": s.l2_pages, "l3": s.l3_pages},
        "hit_ratio": res.hit_ratio,
        "tiers": {t: {"hit_tokens": res.hit_tokens[t], "hit_ratio": res.hit_tokens[t] / pt}
                  for t in TIERS},
        "ideal_hit_ratio": ideal / pt,
        "reference_hit_ratio": reference / pt,
        "evictions": res.evictions, "l3_traffic": res.l3_traffic,
        "uncached_requests": res.uncached_requests,
        "ttft_saved_s": res.ttft_saved_s,
        "ttft_saved_per_request_ms": 1e3 * res.ttft_saved_s / max(res.requests, 1),
        "wall_s": res.wall_s,
    }


def orders(text: str | None) -> list[str] | None:
    """``--compare``'s eviction orders (None: no comparison); ConfigError naming what is
    wrong."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",")]
    bad = [n for n in names if n not in EVICTION_POLICIES]
    if bad:
        raise ConfigError(f"--compare: unknown eviction order(s) {bad}; choose from "
                          f"{', '.join(EVICTION_POLICIES)}")
    if len(names) < 2 or len(set(names)) != len(names):
        raise ConfigError(f"--compare takes two or more different eviction orders, got "
                          f"{text!r}")
    return names


def run(args) -> dict:
    """The replay (and sweep, and comparison) the arguments ask for, as the JSON report."""
    compare = orders(args.compare)
    trace = load(args.trace, args.trace_format, args.block_tokens,
                 max_requests=args.max_requests)
    s, sweep = settings(args, trace)
    runs = _Runs(trace, not args.no_progress)
    out = {"trace": trace.path, "format": trace.format, "block_tokens": trace.block_tokens,
           "page_tokens": s.page_tokens, "eviction": s.eviction, "write": s.write,
           **runs.row(s)}
    sizes = sweep if sweep is not None else [s.l1_pages]
    if sweep is not None:
        out["sweep"] = [runs.row(replace(s, l1_pages=n)) for n in sweep]
    if compare is not None:
        out["compare"] = []
        for n in sizes:
            got = {e: runs.row(replace(s, l1_pages=n, eviction=e)) for e in compare}
            out["compare"].append({
                "capacity_pages": n, "hit_ratio": {e: r["hit_ratio"] for e, r in got.items()},
                "reference_hit_ratio": got[compare[0]]["reference_hit_ratio"]})
    return out


def _print(out: dict) -> None:
    pt = out["page_tokens"]
    print(f"{out['trace']} ({out['format']}, {out['requests']:,} requests, "
          f"{out['prompt_tokens']:,} prompt tokens, pages of {pt} tokens, "
          f"eviction {out['eviction']})")
    rows = [[t, out["capacity_pages"][t] * pt, out["tiers"][t]["hit_tokens"],
             out["tiers"][t]["hit_ratio"]] for t in TIERS]
    print(table(rows, ["tier", "capacity tokens", "hit tokens", "hit ratio"]))
    print(f"hit ratio {out['hit_ratio']:.4f}; ideal (unlimited) {out['ideal_hit_ratio']:.4f}; "
          f"reference (evict furthest next use) {out['reference_hit_ratio']:.4f}")
    ev, l3 = out["evictions"], out["l3_traffic"]
    print(f"evicted pages: l1 {ev['l1_pages']:,}, l2 {ev['l2_pages']:,}, l3 {ev['l3_pages']:,};"
          f" L3 pages written {l3['pages_written']:,}, read {l3['pages_read']:,}; "
          f"TTFT saved {out['ttft_saved_per_request_ms']:.1f} ms/request; "
          f"{out['uncached_requests']} requests found no L1 room; wall {out['wall_s']:.1f} s")
    if "sweep" in out:
        print(table([[r["capacity_pages"]["l1"] * pt, r["hit_ratio"], r["ideal_hit_ratio"],
                      r["reference_hit_ratio"], r["wall_s"]] for r in out["sweep"]],
                    ["l1 tokens", "hit ratio", "ideal", "reference", "wall s"]))
    if "compare" in out:
        first, *rest = out["compare"][0]["hit_ratio"]
        rows = []
        for r in out["compare"]:
            h = r["hit_ratio"]
            rows.append([r["capacity_pages"] * pt, *h.values(),
                         *(f"{h[e] / h[first] - 1:+.1%}" if h[first] else "-" for e in rest),
                         r["reference_hit_ratio"]])
        print(table(rows, ["l1 tokens", *out["compare"][0]["hit_ratio"],
                           *(f"{e} vs {first}" for e in rest), "reference"]))


def main(args) -> int:
    if args.plot and args.capacities is None:
        raise ConfigError("--plot draws the --capacities sweep: give --capacities too")
    out = run(args)
    if args.plot:
        from .plot import plot_sweep
        plot_sweep(out, args.plot)
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        _print(out)
    return 0
