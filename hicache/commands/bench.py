"""``hicache-bench``: the cache-hit benchmark. One trace, every mode side by side.

Modes: recompute (no prefix cache), l1, l1+l2, l1+l2+l3. Each mode replays the same seeded trace
through the DCP MLA engine with HiCache embedded on ``--dcp`` ranks (real processes, gloo on
CPU), then prints one row per mode and writes the same as JSON. The engine runs the built-in
seeded model, or the Hugging Face checkpoint of ``--model DIR`` / the policy's ``[model] path``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .bench_spec import (add_spec_options, rank_spec, spec_main, spec_requested, spec_summary,
                         tpot_summary)
from .bench_tenants import (add_tenant_options, apply_scopes, check_tenant_options,
                            scope_lines, scope_report, with_events)
from .. import preflight
from .bench_model import engine_model, l3_backend
from ..checks import regular_file, system_dir
from .cli import number, run_guarded
from ..config import HiCacheConfig, load_config
from ..controller.policy import WRITE_POLICIES
from ..errors import UsageError
from .report import table
from ..workloads.traces import FORMATS as TRACE_FORMATS
from ..service import CACHE_MODES, RESTORE_RETRIES, HiCache
from ..workloads import (MAX_REQUEST_TOKENS, SCALE_MAX, SEED_MAX, agentic_trace, chat_trace,
                        trace_summary)

from ..paths import default_policy  # noqa: E402

EXAMPLE = default_policy()
WORKLOADS = {"chat": chat_trace, "agentic": agentic_trace}
DEFAULT_SCALE = {"chat": 0.1, "agentic": 0.02}


# ---- one mode on one rank (runs in each spawned process) ---------------------------------------
def run_rank(rank: int, world: int, cfg_dict: dict, mode: str, jobs: list, opts: dict) -> dict:
    import psutil
    import torch
    import torch.distributed as dist

    from ..serving import Server

    torch.manual_seed(0)
    cfg = HiCacheConfig.from_dict(cfg_dict)
    group = dist.group.WORLD if dist.is_initialized() else None
    model = engine_model(cfg, seed=opts["seed"])
    out: dict = {"rank": rank}
    draft, spec = rank_spec(cfg, model, opts)  # --spec: the draft's pages and drafting
    # the built-in model's digest names its weights in the L3 keys
    with HiCache(cfg, rank, group, mode=mode, weights_signature=model.weights_signature(),
                 draft=draft) as cache, _serve_metrics(cache, rank, opts):
        model.to(cache.kv.device)  # the engine computes where its KV port lives
        if spec is not None:
            spec.draft.to(cache.kv.device)
        probe = None
        if opts.get("verify"):  # the rows each served page brought, and first-token logits
            from ..kvcheck import KVProbe
            probe = KVProbe(cache.kv, cache.page_tokens, all_pages=mode == "recompute")
        server = Server(model, cache, group=group, backend=opts["backend"],
                        chunk_tokens=opts["chunk"], max_running=opts["max_running"],
                        max_overtakes=opts.get("max_overtakes", 4), probe=probe, spec=spec)
        bar = _progress_bar(len(jobs), f"{opts['workload']}:{mode}") \
            if rank == 0 and opts["progress"] else None
        t0 = time.perf_counter()
        results = server.run(jobs, on_done=(lambda r: bar.update(1)) if bar else None)
        wall = time.perf_counter() - t0
        if probe is not None:
            out["probe"] = probe.result()
            server.probe = None  # the soak's further passes are not compared
        cache.drain()  # every rank: apply the last transfers and L3 writes before counting
        first = cache.stats()  # the figures of the first pass; the soak only watches for leaks
        first["serving"] = _serving_figures(server)
        prefill = (server.prefill_tokens, server.prefill_s)
        passes, soak = 1, []
        while _agree_continue(opts["duration"] > time.perf_counter() - t0, group):
            server.run([_renamed(j, passes) for j in jobs],
                       on_done=(lambda r: bar.update(1)) if bar else None)
            passes += 1
            s = cache.stats()
            soak.append({"pass": passes, "rss": psutil.Process().memory_info().rss,
                         "l1_pages": s["pages"]["l1"], "l2_pages": s["pages"]["l2"],
                         "locks": s["locks"], "request_pages": cache.request_pages})
        if bar:
            bar.close()
        cache.check()
        out.update(stats=first, final_stats=cache.stats(), wall_s=wall, passes=passes, soak=soak,
                   prefill_tokens=prefill[0], prefill_s=prefill[1])
    out["results"] = [(r.request_id, r.prompt_len, r.output, r.ttft_s, r.hit, r.tpot_s, r.spec,
                       r.decode_tpot_s) for r in results]
    return out


@contextmanager
def _serve_metrics(cache, rank: int, opts: dict):
    """``--metrics-port N``: rank r serves its own /metrics on 127.0.0.1:N+r while it runs."""
    port = opts.get("metrics_port")
    if not port:
        yield None
        return
    from ..metrics import HiCacheMetrics
    metrics = HiCacheMetrics(cache, rank=rank)
    try:
        metrics.serve(port + rank)
    except OSError as e:
        raise UsageError(f"--metrics-port: cannot serve rank {rank} on 127.0.0.1:{port + rank}: "
                         f"{e}") from None
    try:
        yield metrics
    finally:
        metrics.close()


def _progress_bar(total: int, desc: str):
    """Rank 0's progress bar (tqdm), on stderr."""
    from tqdm import tqdm
    # a thread lock: tqdm's default makes a named semaphore, which a rank (it exits
    # without interpreter teardown) would leave to the parent's resource tracker
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr)


def _serving_figures(server) -> dict:
    """The serving loop's counters after a pass (``stall_summary`` reads them)."""
    return {"preemptions": server.preemptions, "blocked_steps": server.blocked_steps,
            "longest_stall": server.longest_stall, "overtakes": server.overtakes,
            "rematches": server.rematches, "probes_returned": server.probes_returned,
            "cache_s": dict(server.cache_s), "prefill_s": server.prefill_s}


def _agree_continue(local: bool, group) -> bool:
    """Rank 0's clock decides whether the soak replays again, for every rank alike."""
    from ..distributed import rank0_decides
    return rank0_decides(local, group)


def _renamed(job, n: int):
    from dataclasses import replace
    return replace(job, request_id=(n, job.request_id))


def run_mode(cfg: HiCacheConfig, mode: str, jobs: list, opts: dict) -> dict:
    c = cfg.parallel.dcp
    if c == 1:
        ranks = [run_rank(0, 1, cfg.to_dict(), mode, jobs, opts)]
    else:
        from ..distributed import launch
        ranks = launch(c, run_rank, cfg.to_dict(), mode, jobs, opts, timeout_s=3600)
    return summarize(mode, ranks, opts)


@dataclass(frozen=True)
class Variant:
    """One row of the table: a mode, under a write policy and an admission rule."""

    name: str
    mode: str
    write: str
    max_overtakes: int


def variants(cfg: HiCacheConfig, modes: list[str], writes: list[str] | None,
             overtakes: list[int]) -> list[Variant]:
    """Modes x write policies (modes with L2 only) x ``max_overtakes``; a name says what
    differs from the other rows (``l1+l2 write_back``, ``l1 overtake=0``)."""
    out = []
    for m in modes:
        for w in (writes if writes and "l2" in CACHE_MODES[m] else [cfg.policy.write]):
            for k in overtakes:
                name = m + (f" {w}" if writes and len(writes) > 1 and "l2" in CACHE_MODES[m]
                            else "")
                name += f" overtake={k}" if len(overtakes) > 1 else ""
                out.append(Variant(name, m, w, k))
    return out


def run_variants(cfg: HiCacheConfig, vs: list[Variant], jobs: list, opts: dict,
                 reps: int = 1) -> list[dict]:
    """Every variant ``reps`` times, interleaved (rep 1 of each, then rep 2 of each, ...), so a
    machine whose load drifts slows every variant alike; each row reports the median of its
    reps for the timings (TTFT percentiles, tok/s, wall) and keeps every rep's figures."""
    runs: list[list[dict]] = [[] for _ in vs]
    for _ in range(reps):
        for i, v in enumerate(vs):
            c = cfg if v.write == cfg.policy.write else cfg.replace(policy={"write": v.write})
            with _cold_l3(c, opts.get("cold_l3") and "l3" in CACHE_MODES[v.mode]) as c:
                runs[i].append(run_mode(c, v.mode, jobs,
                                        {**opts, "max_overtakes": v.max_overtakes}))
    rows = []
    for v, rs in zip(vs, runs):
        row = dict(rs[0], name=v.name, mode=v.mode, write=v.write, max_overtakes=v.max_overtakes)
        if reps > 1:
            row["ttft_s"] = {q: float(np.median([r["ttft_s"][q] for r in rs]))
                             for q in rs[0]["ttft_s"]}
            for k in ("throughput_tok_s", "wall_s"):
                row[k] = float(np.median([r[k] for r in rs]))
            row["reps"] = [{k: r[k] for k in ("ttft_s", "throughput_tok_s", "wall_s", "hit_ratio",
                                              "serving_s", "copies")} for r in rs]
        rows.append(row)
    scope_report(rows, jobs)  # each row's hits per scope (--scope / --scopes)
    return rows


@contextmanager
def _cold_l3(cfg: HiCacheConfig, cold: bool):
    """``--cold-l3``: the run gets an empty L3 store of its own (the backend's ``scratch``: for
    LMDB a fresh directory beside its path, removed afterwards), so every rep of an L3 mode
    starts cold."""
    if not cold:
        yield cfg
        return
    from ..l3 import registry
    with registry.get(cfg.l3.backend).scratch(cfg.l3.options) as keys:
        yield cfg.replace(l3={cfg.l3.backend: keys})


def summarize(mode: str, ranks: list[dict], opts: dict) -> dict:
    r0 = ranks[0]
    res = r0["results"]
    ttft = np.array([r[3] for r in res]) if res else np.zeros(1)
    prompt = sum(r[1] for r in res)
    hits = {t: sum(r[4][t] for r in res) for t in ("l1", "l2", "l3")}
    out_tokens = sum(len(r[2]) for r in res)
    byts = {k: sum(r["stats"]["bytes"][k] for r in ranks) for k in r0["stats"]["bytes"]}
    gbps = {d: sum(r["stats"]["gbps"][d] for r in ranks) / len(ranks) for d in ("d2h", "h2d")}
    st = r0["stats"]
    row = {
        "name": mode,
        "hit_ratio": sum(hits.values()) / prompt if prompt else 0.0,
        "hit_tokens": hits,
        "prompt_tokens": prompt,
        "output_tokens": out_tokens,
        "ttft_s": {f"p{q}": float(np.percentile(ttft, q)) for q in (50, 90, 99)},
        "throughput_tok_s": (prompt + out_tokens) / r0["wall_s"] if r0["wall_s"] else 0.0,
        "bytes": byts,
        "gbps": gbps,
        "controller_us_per_request": 1e6 * st["controller_s"] / max(st["requests"], 1),
        "agreement_us_per_step": 1e6 * st["agreement_s"] / max(st["steps"], 1),
        "evictions": st["evictions"],
        "stall": stall_summary(st),
        # rank 0's scheduler thread: seconds in each cache call, prefill compute, copy jobs
        "serving_s": {**st.get("serving", {}).get("cache_s", {}),
                      "prefill": st.get("serving", {}).get("prefill_s", 0.0)},
        "copies": {"backups": st["copy_ops"]["d2h"], "loads": st["copy_ops"]["h2d"],
                   "d2h_s": st["transfer_s"]["d2h"], "h2d_s": st["transfer_s"]["h2d"]},
        "corrupt_l3_values": sum(r["stats"]["corrupt"] for r in ranks),
        **l3_health(ranks),
        "wall_s": r0["wall_s"],
        "passes": r0["passes"],
        "prefill_tokens": r0["prefill_tokens"],
        "outputs": {str(r[0]): r[2] for r in res},
        "requests": [{"id": str(r[0]), "prompt_tokens": r[1], "ttft_s": r[3], "hit_tokens": r[4]}
                     for r in res],
    }
    if "hybrid" in st:  # hybrid checkpoints: KDA state snapshots (docs/hybrid.md)
        row["hybrid"] = hybrid_summary(ranks)
    row["tpot_s"] = tpot_summary(res)
    if any(r[6] for r in res):  # --spec: the speculative figures (hicache/commands/bench_spec.py)
        row["speculative"] = spec_summary([r[6] for r in res])
    row["final_stats"] = [r["final_stats"] for r in ranks]  # per rank, after the soak
    if all("probe" in r for r in ranks):  # --verify: compared, then dropped from the report
        row["probes"] = [r["probe"] for r in ranks]
    if opts["duration"]:
        row["soak"] = _soak_verdict([r["soak"] for r in ranks])
    return row


def hybrid_summary(ranks: list[dict]) -> dict:
    """Snapshot figures of one mode: hits and bytes per tier (rank 0's: L1 and L2 copies are
    replicated; L3 writes summed over ranks, one writer per group) and the matched tokens
    recomputed because no snapshot was there (truncation)."""
    h = ranks[0]["stats"]["hybrid"]
    written = dict(h["written_bytes"], l3=sum(r["stats"]["hybrid"]["written_bytes"]["l3"]
                                             for r in ranks))
    return {"snapshot_bytes": h["snapshot_bytes"], "snapshot_hits": h["hits"],
            "lost_tokens": h["lost_tokens"], "written_bytes": written,
            "read_bytes": h["read_bytes"]}


def l3_health(ranks: list[dict]) -> dict:
    """What went wrong with L3 in one mode's run, over its ranks: ``l3_errors`` (calls answered
    as misses because the store was unavailable, plus store errors that ended L3 on a rank),
    ``l3_auth_failures``, and ``l3_problem`` (the store, no password; the ranks; the first
    error) when there was any error. Modes without L3 have none of these."""
    stats = [r["stats"] for r in ranks]
    if not any("l3_errors" in s for s in stats):
        return {}
    errors = [s.get("l3_errors", 0) + s.get("l3_failures", 0) for s in stats]
    out = {"l3_errors": sum(errors),
           "l3_auth_failures": sum(s.get("l3_auth_failures", 0) for s in stats)}
    bad = [r["rank"] for r, n in zip(ranks, errors) if n]
    if bad:
        first = next((s.get("l3_error") for s in stats if s.get("l3_error")), None)
        out["l3_problem"] = {"where": stats[0].get("l3_where", "?"), "ranks": bad,
                             "first_error": first or "?"}
    return out


def l3_warnings(rows: list[dict]) -> list[str]:
    """One line per rank group (a mode's run) whose configured L3 failed."""
    out = []
    for r in rows:
        p = r.get("l3_problem")
        if p:
            out.append(f"warning: L3 {p['where']} failed in {r['name']} on rank(s) "
                       f"{','.join(map(str, p['ranks']))} ({r['l3_errors']} errors; L3 "
                       f"answered misses): first error: {p['first_error']}")
    return out


def stall_summary(stats: dict) -> dict:
    """How much the run waited for L1 room. ``stalled``: an agreed L3 restore fell back to
    recompute, or requests waited more than RESTORE_RETRIES steps in a row with nothing running
    (the speed-up of such a run is not reported: it measured a stall, not the cache)."""
    sv = stats.get("serving", {})
    out = {"preemptions": sv.get("preemptions", 0), "blocked_steps": sv.get("blocked_steps", 0),
           "longest_stall": sv.get("longest_stall", 0), "overtakes": sv.get("overtakes", 0),
           "rematches": sv.get("rematches", 0), "probes_returned": sv.get("probes_returned", 0),
           "restore_wait_steps": stats.get("restore_wait_steps", 0),
           "restore_fallbacks": stats.get("restore_fallbacks", 0)}
    out["stalled"] = bool(out["restore_fallbacks"] or out["longest_stall"] > RESTORE_RETRIES)
    return out


def verify_outputs(reference: dict, rows: list[dict], ref_probes: list | None = None) -> dict:
    """Compare each mode's token ids with recompute's, request by request; with the runs'
    probes (``hicache.kvcheck``), also the KV rows of every page each mode served and the
    first-token logits, rank by rank (``kv``: per mode, a ``Comparison``'s figures)."""
    from ..kvcheck import Comparison, compare
    differs, kv = {}, {}
    for r in rows:
        out = r["outputs"]
        bad = sum(1 for k in set(reference) | set(out) if out.get(k) != reference.get(k))
        if bad:
            differs[r["name"]] = bad
        probes = r.pop("probes", None)
        if ref_probes and probes and r.get("mode", r["name"]) != "recompute":
            c = Comparison()
            for ref, got in zip(ref_probes, probes):
                c.add(compare(ref, got))
            kv[r["name"]] = c.as_dict()
    corrupt = {m: c for m, c in kv.items() if c["bad_pages"] or c["bad_logits"]}
    return {"reference": "recompute", "requests": len(reference),
            "equal": not differs and not corrupt, "differs": differs, "kv": kv,
            "kv_corrupt": corrupt}


def ideal_hit_ratio(jobs: list, outputs: dict, page_tokens: int) -> float:
    """The hit ratio with unlimited memory: each request, in arrival order, hits every whole
    page an earlier request computed (its prompt and the tokens it generated)."""
    from ..controller import CacheController
    from ..scope import make_scope
    total_pages = sum(len(j.tokens) + len(outputs[str(j.request_id)]) for j in jobs)
    ctrl = CacheController(page_tokens, total_pages // page_tokens + 1, 0)
    hits = prompt = 0
    for j in jobs:  # (in each request's scope: --scope / --scopes)
        sc = make_scope(getattr(j, "scope", None), getattr(j, "public_tokens", 0), page_tokens)
        m = ctrl.match(j.tokens[:-1], scope=sc)
        hits += m.device_len
        prompt += len(j.tokens)
        fed = np.concatenate([j.tokens, np.asarray(outputs[str(j.request_id)][:-1], dtype=np.int64)])
        n = len(fed) // page_tokens
        pages = m.device_pages.tolist() + ctrl.alloc_device(n - len(m.device_pages))
        ctrl.insert(fed[:n * page_tokens], pages, scope=sc)
    return hits / prompt if prompt else 0.0


def _soak_verdict(per_rank: list[list[dict]]) -> dict:
    """Once warm (after the second pass), memory, pages and locks must stay flat."""
    verdict = {"passes": len(per_rank[0]) + 1, "leak": None}
    for rank, samples in enumerate(per_rank):
        if len(samples) < 3:
            continue
        warm, last = samples[1], samples[-1]
        if last["locks"] or last["request_pages"]:
            verdict["leak"] = f"rank {rank}: {last['locks']} open locks, " \
                              f"{last['request_pages']} request pages after the soak"
        elif last["rss"] - warm["rss"] > warm["rss"] // 10 + (64 << 20):
            verdict["leak"] = (f"rank {rank}: resident memory grew from {warm['rss'] >> 20} MiB "
                               f"to {last['rss'] >> 20} MiB once warm")
        verdict.setdefault("rss_mib", []).append([warm["rss"] >> 20, last["rss"] >> 20])
        verdict.setdefault("pages", []).append([(s["l1_pages"], s["l2_pages"]) for s in samples])
    return verdict


# ---- the command -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hicache-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_options(p)
    _add_comparison_options(p)
    _add_output_options(p)
    _add_soak_options(p)
    add_spec_options(p)  # spec: --spec none,mtp|draft rows (hicache/commands/bench_spec.py)
    add_tenant_options(p)  # --scope / --scopes / --kv-events (hicache/commands/bench_tenants.py)
    p.add_argument("--no-progress", action="store_true")
    return p


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """What runs: the policy file and its overrides, the trace, the requests."""
    p.add_argument("--workload", default="chat,agentic",
                   help="chat, agentic, or both comma-separated (default: both)")
    p.add_argument("--config", default=str(EXAMPLE), help="policy file (default: the example)")
    p.add_argument("--l3-path", help="L3 directory (overrides the policy file)")
    p.add_argument("--l3-url", help="shared L3 on Redis / Valkey (overrides the policy file): "
                   "redis://host:port/db, unix:///path.sock, or comma-separated cluster nodes")
    p.add_argument("--model", help="Hugging Face DeepSeek-V2/V3 or Kimi Linear checkpoint "
                   "directory to run (replaces the policy file's [model] section)")
    p.add_argument("--dcp", type=int, help="DCP ranks to spawn (overrides the policy file)")
    p.add_argument("--modes", default=",".join(CACHE_MODES), help="comma-separated, any of "
                   + ", ".join(CACHE_MODES))
    p.add_argument("--scale", type=float, default=None,
                   help="trace size, 1.0 = full (default: chat 0.1, agentic 0.02: ~2 min on "
                        "2 CPU cores)")
    p.add_argument("--seed", type=int, default=0, help="in [0, 2**63 - 1]")
    p.add_argument("--trace", help="replay a recorded JSONL trace instead of a workload")
    p.add_argument("--trace-format", default="hicache", choices=TRACE_FORMATS,
                   help="--trace's format: Mooncake FAST'25 or Qwen-Bailian hash ids, or "
                        "hicache's own JSONL (default)")
    p.add_argument("--block-tokens", type=int, default=None,
                   help="tokens per hash id of a mooncake/bailian trace (default: the "
                        "format's, 512 / 16; smaller scales the trace down to fit a small model)")
    p.add_argument("--max-requests", type=int, default=None,
                   help="run only the first N requests of --trace")
    p.add_argument("--max-output", type=int, default=24,
                   help="cap generated tokens per request (0 = as the trace says)")
    p.add_argument("--max-running", type=int, default=4, help="requests in flight")


def _add_comparison_options(p: argparse.ArgumentParser) -> None:
    """The rows compared: write policies, admission, reps, L3 state, engine, verify."""
    p.add_argument("--write", help="compare L2 write policies: comma-separated, any of "
                   + ", ".join(WRITE_POLICIES) + " (one row per policy for each mode with L2; "
                   "default: the policy file's)")
    p.add_argument("--max-overtakes", default="4", metavar="N[,N...]",
                   help="requests that may start before one waiting for L1 room (0 = hold "
                        "admission until it got room); several values compare them (default 4)")
    p.add_argument("--reps", type=int, default=1,
                   help="run every row this many times, interleaved, and report the median "
                        "timings (use on a busy machine; l1+l2+l3 reps after the first start "
                        "warm unless --cold-l3)")
    p.add_argument("--require-l3", action="store_true",
                   help="exit 3 when L3 was configured but failed in a mode (unavailable, "
                        "refused, TLS mismatch: the run's warning line says which)")
    p.add_argument("--cold-l3", action="store_true",
                   help="every run of an L3 mode starts on an empty store of its own (a fresh "
                        "directory beside the LMDB l3.path, removed after the run): cold reps")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens")
    from ..engine.dcp import DCP_BACKENDS  # the engine's list is the one home of these names
    p.add_argument("--backend", default=DCP_BACKENDS[0], choices=DCP_BACKENDS)
    p.add_argument("--verify", action="store_true",
                   help="token ids of every mode must equal recompute's (run for the purpose "
                        "when recompute is not among --modes); exit 1 otherwise")


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """Where the report goes."""
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    p.add_argument("--plot", help="TTFT distribution and hit ratio by tier (needs matplotlib)")


def _add_soak_options(p: argparse.ArgumentParser) -> None:
    """The soak, the fault soak and the live metrics."""
    p.add_argument("--duration", type=float, default=0.0,
                   help="soak: keep replaying for this many seconds, fail on a leak")
    p.add_argument("--faults", type=int, metavar="SEED", default=None,
                   help="fault-injection soak (with --duration, 2+ ranks): seeded failed and "
                        "slow copies, corrupted/deleted/erroring L3 reads, late steps; checks "
                        "tokens against recompute, agreement, leaks, hangs")
    p.add_argument("--fault-every", type=int, default=40, metavar="STEPS",
                   help="--faults: one injection every STEPS scheduler steps on average")
    p.add_argument("--fault-kinds", default=None, metavar="K,..",
                   help="--faults: the kinds drawn (default: every kind but the opt-in ones; "
                        "kv_corrupt is a mutation the soak's KV check must report)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus /metrics on 127.0.0.1: rank r of each mode on PORT+r "
                        "while it runs (0 = off)")


def _jobs(args, workload: str, cfg: HiCacheConfig) -> list:
    vocab = cfg.model.vocab_size
    if args.trace:
        from ..workloads.traces import as_requests, load
        jobs = as_requests(load(args.trace, args.trace_format, args.block_tokens,
                                max_requests=args.max_requests, vocab=vocab, seed=args.seed),
                           vocab)
    else:
        scale = args.scale or DEFAULT_SCALE[workload]
        jobs = WORKLOADS[workload](seed=args.seed, scale=scale, vocab_size=vocab)
    if args.max_output:
        from dataclasses import replace
        jobs = [replace(j, output_len=max(1, min(j.output_len, args.max_output))) for j in jobs]
    check_fit(jobs, cfg, args.trace or "")
    return apply_scopes(args, jobs)


def _names(flag: str, text: str, known) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise UsageError(f"{flag}: no name given in {text!r}; expected any of {', '.join(known)}")
    for x in names:
        if x not in known:
            raise UsageError(f"{flag}: unknown {flag[2:].rstrip('s')} {x!r}; expected any of "
                             f"{', '.join(known)}")
    return names


def check_destination(flag: str, path: str, suffixes: tuple[str, ...] = ()) -> Path:
    """An output file the run will write: checked (and its directory made) before the run, so
    a long run never ends in a report it cannot save."""
    if not path or "\0" in path:
        raise UsageError(f"{flag}: {path!r} is not a file name")
    p = Path(path)
    d = system_dir(p)
    if d is not None:
        raise UsageError(f"{flag}: {path!r} is under {d}; give a file in a normal directory")
    if p.is_dir() or path.endswith(("/", os.sep)):
        raise UsageError(f"{flag}: {path!r} is a directory; give a file name")
    if p.exists():  # a FIFO would block the final write until a reader comes
        regular_file(p, f"the {flag} file", UsageError)
    if suffixes and p.suffix.lower().lstrip(".") not in suffixes:
        raise UsageError(f"{flag}: {path!r} has no supported extension; use one of "
                         f"{', '.join('.' + s for s in suffixes)}")
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"{flag}: {path!r} is not writable")
    parent = p.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag}: cannot create directory {str(parent)!r}: "
                         f"{e.strerror or e}") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: directory {str(parent)!r} is not writable")
    return p


def _l3_at(cfg: HiCacheConfig, where, flag: str) -> HiCacheConfig:
    """``--l3-path DIR`` (the default backend's directory) / ``--l3-url URL[,URL...]`` (the
    registered backend that claims the URL)."""
    from ..l3 import registry
    if flag == "--l3-path":
        b = registry.get(registry.DEFAULT)
    else:
        b = registry.for_where(where)
        if not b.claims(where):
            raise UsageError(f"{flag}: {where!r} is not a URL that a registered L3 backend "
                             f"({', '.join(registry.names())}) takes")
    return cfg.replace(l3={"backend": b.name, b.name: b.section_of(where)})


def _resolve(args) -> tuple[HiCacheConfig, list[Variant], list[str]]:
    cfg = _policy(args)
    modes = _names("--modes", args.modes, CACHE_MODES)
    writes = _names("--write", args.write, WRITE_POLICIES) if args.write is not None else None
    overtakes = _overtakes(args.max_overtakes)
    number("--reps", args.reps, 1, 1000)
    cfg = _checked_stores(args, cfg, modes)
    if args.trace:
        workloads = [Path(args.trace).stem]
    else:
        workloads = _names("--workload", args.workload, WORKLOADS)
    _check_numbers(args, cfg)
    if args.faults is not None:
        _check_faults(args, cfg)
    _check_outputs(args)
    tiers = tuple(sorted({t for m in modes for t in CACHE_MODES[m]}))
    for w in preflight.validate(cfg, tiers=tiers):  # before any rank is spawned
        print(f"warning: {w}", file=sys.stderr)
    return cfg, variants(cfg, modes, writes, overtakes), workloads


def _policy(args) -> HiCacheConfig:
    """The policy file with the command line's overrides: --model, --l3-path / --l3-url,
    --dcp."""
    cfg = load_config(args.config)
    if args.model:  # the checkpoint sets the KV shape: the file's model keys give way
        d = cfg.to_dict()
        d["model"] = {"path": args.model}
        cfg = HiCacheConfig.from_dict(d)
    if args.l3_path is not None and args.l3_url is not None:
        raise UsageError("--l3-path and --l3-url name two L3 stores; give one")
    if args.l3_path is not None:  # "" is an error (preflight), not "use the policy file's"
        cfg = _l3_at(cfg, args.l3_path, "--l3-path")
    if args.l3_url is not None:  # "" is an error (l3.redis.url), not "use the policy file's"
        urls = [u.strip() for u in args.l3_url.split(",") if u.strip()]
        if not urls:
            raise UsageError("--l3-url: empty; give redis://host:port/db or cluster node URLs")
        cfg = _l3_at(cfg, urls if len(urls) > 1 else args.l3_url, "--l3-url")
    if args.dcp is not None:  # the policy file's tp / attn_dp must allow it
        if not 1 <= args.dcp <= 4096:
            raise UsageError(f"--dcp must be in [1, 4096], got {args.dcp}")
        cfg = cfg.replace(parallel={"dcp": args.dcp})
    check_tenant_options(args)
    return with_events(args, cfg)


def _overtakes(text) -> list[int]:
    """--max-overtakes N[,N...]: each an integer in [0, 65536]."""
    overtakes = []
    for x in str(text).split(","):
        try:
            overtakes.append(int(x))
        except ValueError:
            raise UsageError(f"--max-overtakes: {x.strip()!r} is not an integer") from None
        number("--max-overtakes", overtakes[-1], 0, 1 << 16)
    return overtakes


def _checked_stores(args, cfg: HiCacheConfig, modes: list[str]) -> HiCacheConfig:
    """The checkpoint's heads split over the ranks, --cold-l3's backend can make an empty
    store, and L3 is on when a mode uses it."""
    if cfg.model.path:  # every tensor's name and shape checked here, before any rank starts
        heads = engine_model(cfg).cfg.num_heads
        if heads % cfg.parallel.dcp:
            raise UsageError(f"dcp {cfg.parallel.dcp} does not divide the {heads} attention heads "
                             f"of {cfg.model.path}")
    if args.cold_l3 and l3_backend(cfg).scratch is None:
        raise UsageError(f"--cold-l3 needs an L3 backend that can make an empty store per run "
                         f"(lmdb: a directory); l3.backend is {cfg.l3.backend!r}")
    if "l1+l2+l3" in modes and not cfg.l3.enabled:
        cfg = cfg.replace(l3={"enabled": True})
    return cfg


def _check_numbers(args, cfg: HiCacheConfig) -> None:
    """Every numeric flag within its range; --metrics-port's ports free."""
    for name, hi in (("max_running", 1 << 16), ("chunk", MAX_REQUEST_TOKENS)):
        number(f"--{name.replace('_', '-')}", getattr(args, name), 1, hi)
    number("--max-output", args.max_output, 0, MAX_REQUEST_TOKENS)
    number("--duration (seconds)", args.duration, 0, 30 * 86400)
    number("--seed", args.seed, 0, SEED_MAX)
    if args.scale is not None:
        number("--scale", args.scale, 0, SCALE_MAX, lo_open=True)
    if args.metrics_port:
        _check_ports(args.metrics_port, cfg.parallel.dcp)


def _check_faults(args, cfg: HiCacheConfig) -> None:
    """--faults: a duration, 2+ ranks, known kinds (``args.fault_kinds`` becomes a tuple), and
    none of the flags the fault soak does not use."""
    if args.duration <= 0:
        raise UsageError("--faults needs --duration SECONDS > 0 (how long to soak)")
    if cfg.parallel.dcp < 2:
        raise UsageError(f"--faults needs 2 or more ranks (--dcp), got {cfg.parallel.dcp}")
    number("--faults (seed)", args.faults, 0, SEED_MAX)
    number("--fault-every", args.fault_every, 2, 1 << 20)
    if args.fault_kinds is not None:
        from ..faults import KINDS
        kinds = tuple(k.strip() for k in args.fault_kinds.split(",") if k.strip())
        bad = [k for k in kinds if k not in KINDS or k == "l3_restart"]
        if bad or not kinds:
            raise UsageError(f"--fault-kinds: unknown kind {(bad or [''])[0]!r}; expected "
                             f"some of {', '.join(k for k in KINDS if k != 'l3_restart')}")
        args.fault_kinds = kinds
    given = [f for f, on in (("--write", args.write is not None),
                             ("--max-overtakes", str(args.max_overtakes) != "4"),
                             ("--reps", args.reps != 1), ("--cold-l3", args.cold_l3)) if on]
    if given:
        raise UsageError(f"{', '.join(given)}: not used by the fault soak (--faults)")


def _check_outputs(args) -> None:
    """--plot and --out: files the run can write (and matplotlib for --plot)."""
    if args.plot:
        from .plot import FORMATS
        check_destination("--plot", args.plot, FORMATS)
        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError("--plot needs matplotlib: pip install 'hicache[plot]'")
    if args.out is not None:
        check_destination("--out", args.out)


def check_fit(jobs: list, cfg: HiCacheConfig, source: str) -> None:
    """Every request must fit L1 whole (prompt + output); checked before the run."""
    capacity = cfg.l1_tokens
    for i, j in enumerate(jobs):
        need = len(j.tokens) + j.output_len
        if need > capacity:
            where = f"{source}: request {i + 1}" if source else f"request {j.request_id}"
            raise UsageError(f"{where}: request needs {need} tokens of KV (prompt "
                             f"{len(j.tokens)} + output {j.output_len}) but L1 holds {capacity} "
                             f"(l1.num_pages {cfg.l1.num_pages} x {cfg.page_tokens}); "
                             "raise l1.num_pages or lower --max-output / --scale")


def _check_ports(port: int, ranks: int) -> None:
    """--metrics-port N needs N..N+ranks-1 free on 127.0.0.1 (one per rank)."""
    import socket
    if not 1024 <= port <= 65536 - ranks:
        raise UsageError(f"--metrics-port must leave room for {ranks} ports in [1024, 65535], "
                         f"got {port}")
    for p in range(port, port + ranks):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", p))
            except OSError as e:
                raise UsageError(f"--metrics-port: 127.0.0.1:{p} is not free ({e.strerror})") \
                    from None


def machine() -> dict:
    import torch
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _run(args) -> int:
    if spec_requested(args):  # spec: speculative rows side by side, not the cache workloads
        return spec_main(args, _policy(args))
    return _main(args)


def _main(args) -> int:
    cfg, vs, workloads = _resolve(args)
    if args.faults is not None:
        return _faults_main(args, cfg, workloads[0])
    report = {"config": cfg.public_dict(), "machine": machine(), "workloads": []}
    l3_failed = False
    failed = []
    all_jobs = {w: _jobs(args, w, cfg) for w in workloads}  # every trace checked before a run
    for w in workloads:
        jobs = all_jobs[w]
        opts = {"seed": args.seed, "backend": args.backend, "chunk": args.chunk,
                "max_running": args.max_running, "progress": not args.no_progress,
                "duration": args.duration, "workload": w, "metrics_port": args.metrics_port,
                "cold_l3": args.cold_l3, "verify": args.verify}
        rows = run_variants(cfg, vs, jobs, opts, args.reps)
        entry = {"workload": w, "trace": trace_summary(jobs), "modes": rows,
                 "ideal_hit_ratio": ideal_hit_ratio(jobs, rows[0]["outputs"],
                                                    cfg.page_tokens)}
        if args.verify:  # always against recompute, run for the purpose when not a mode
            ref = next((r for r in rows if r.get("mode", r["name"]) == "recompute"), None) \
                or run_mode(cfg, "recompute", jobs, opts)
            entry["verify"] = v = verify_outputs(ref["outputs"], rows, ref.pop("probes", None))
            for name, n in v["differs"].items():
                failed.append(f"{w}: token ids of {n} of {v['requests']} requests differ from "
                              f"recompute in {name}")
            for name, c in v["kv_corrupt"].items():
                failed.append(f"{w}: {name} served KV that differs from recompute's: "
                              f"{c['bad_pages']} of {c['pages']} pages, first-token logits of "
                              f"{c['bad_logits']} requests (max |diff| "
                              f"{c['logits_max_abs_diff']:.3g})")
        for r in rows:
            r.pop("probes", None)
        for r in rows:
            if r.get("soak", {}).get("leak"):
                failed.append(f"{w}:{r['name']}: leak: {r['soak']['leak']}")
        report["workloads"].append(entry)
        if not args.json:
            _print(w, entry, cfg)
        for line in l3_warnings(rows):  # loud, even with --json (stderr)
            l3_failed = True
            print(line, file=sys.stderr)
    if len(workloads) == 1:  # the documented top-level shape for one workload
        report["modes"] = report["workloads"][0]["modes"]
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        print(text)
    if args.plot:
        from .plot import plot_report
        plot_report(report, args.plot)
    for f in failed:
        print(f"FAIL {f}", file=sys.stderr)
    if failed:
        return 1
    if l3_failed and args.require_l3:
        print("FAIL --require-l3: L3 was configured but failed (see the warning above)",
              file=sys.stderr)
        return 3
    return 0


def _faults_main(args, cfg: HiCacheConfig, workload: str) -> int:
    """--faults: the fault-injection soak on the first workload (hicache.commands.soak)."""
    from .soak import run_soak, table_rows
    jobs = _jobs(args, workload, cfg)
    opts = {"seed": args.seed, "backend": args.backend, "chunk": args.chunk,
            "max_running": args.max_running, "duration": args.duration, "faults": args.faults,
            "fault_every": args.fault_every, "fault_kinds": args.fault_kinds,
            "metrics_port": args.metrics_port}
    f = run_soak(cfg, jobs, opts)
    report = {"config": cfg.public_dict(), "machine": machine(), "workload": workload,
              "trace": trace_summary(jobs), "faults": f}
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.json:
        print(text)
    elif "injected" in f:
        print(f"\n== fault soak: {workload}, seed {args.faults}, {args.duration:g} s, dcp "
              f"{cfg.parallel.dcp}")
        print(table(table_rows(f), ["check", "value"]))
        for n in f["notes"]:
            print(f"  note: {n}")
    bad = f.get("problems") or ([f"soak failed: {f.get('error', '?')[-500:]}"]
                                if "injected" not in f else [])
    for p in bad:
        print(f"FAIL faults: {p}", file=sys.stderr)
    return 1 if bad else 0


def _print(workload: str, entry: dict, cfg: HiCacheConfig) -> None:
    t = entry["trace"]
    print(f"\n== {workload}: {t.get('requests')} requests, {t.get('prompt_tokens')} prompt tokens; "
          f"dcp {cfg.parallel.dcp}, P {cfg.cache.page_size} (pages of "
          f"{cfg.page_tokens}), L1 {cfg.l1.num_pages} pages, L2 {cfg.l2_num_pages} pages")
    rows = []
    for r in entry["modes"]:
        h = r["hit_tokens"]
        p = max(r["prompt_tokens"], 1)
        stall = r.get("stall", {})
        rows.append([r["name"], r["hit_ratio"], h["l1"] / p, h["l2"] / p, h["l3"] / p,
                     r["ttft_s"]["p50"] * 1e3, r["ttft_s"]["p90"] * 1e3, r["ttft_s"]["p99"] * 1e3,
                     r["throughput_tok_s"], r["bytes"]["d2h"] / 1e6, r["bytes"]["h2d"] / 1e6,
                     r["bytes"]["l3_read"] / 1e6, r["bytes"]["l3_write"] / 1e6,
                     r["gbps"]["h2d"], r["controller_us_per_request"],
                     sum(r["evictions"].values()), stall.get("preemptions", 0),
                     stall.get("overtakes", 0), r.get("copies", {}).get("backups", 0),
                     1e3 * (r.get("copies", {}).get("d2h_s", 0.0)
                            + r.get("copies", {}).get("h2d_s", 0.0)),
                     r.get("l3_errors", "-")])
    print(table(rows, ["mode", "hit", "l1", "l2", "l3", "ttft p50 ms", "p90 ms", "p99 ms",
                       "tok/s", "d2h MB", "h2d MB", "l3 rd MB", "l3 wr MB", "h2d GB/s",
                       "ctrl us/req", "evict", "preempt", "overtake", "backups", "copy ms",
                       "l3 err"]))
    reps = entry["modes"][0].get("reps") if entry["modes"] else None
    if reps:
        print(f"  timings are medians of {len(reps)} interleaved runs per row")
    print(f"  unlimited memory would hit {entry['ideal_hit_ratio']:.3f} of prompt tokens")
    base = next((r for r in entry["modes"] if r.get("mode", r["name"]) == "recompute"), None)
    for r in entry["modes"]:
        st = r.get("stall", {})
        if st.get("stalled"):
            print(f"  {r['name']}: STALLED waiting for L1 room ({st['restore_fallbacks']} L3 "
                  f"restores fell back to recompute, longest wait {st['longest_stall']} "
                  f"steps, {st['preemptions']} preemptions): no speed-up reported")
        elif base and r is not base and r["ttft_s"]["p50"]:
            print(f"  {r['name']}: TTFT p50 {base['ttft_s']['p50'] / r['ttft_s']['p50']:.2f}x "
                  f"faster than recompute")
    _print_hybrid(entry["modes"])
    for line in scope_lines(entry["modes"]):
        print(line)
    for r in entry["modes"]:
        soak = r.get("soak")
        if soak:
            rss = ", ".join(f"{a}->{b}" for a, b in soak.get("rss_mib", []))
            print(f"  soak {r['name']}: {soak['passes']} passes; resident MiB per rank once warm "
                  f"{rss or 'n/a'}; pages (l1, l2) per pass {soak.get('pages', [[]])[0]}; "
                  f"leak: {soak['leak'] or 'none'}")
    v = entry.get("verify")
    if v and v["equal"]:
        print(f"  verify: token ids equal to recompute in every mode ({v['requests']} requests)")
    elif v and v["differs"]:
        print("  verify: token ids DIFFER from recompute: " + ", ".join(
            f"{m} ({n} of {v['requests']} requests)" for m, n in v["differs"].items()))
    if v:
        from ..kvcheck import Comparison
        for m, c in v["kv"].items():
            flag = "CORRUPT " if m in v["kv_corrupt"] else ""
            print(f"  verify {m}: {flag}{Comparison(**c).line()}")


def _print_hybrid(modes: list[dict]) -> None:
    """Hybrid checkpoints: each mode's KDA snapshot hits, truncation and bytes per tier."""
    for r in modes:
        h = r.get("hybrid")
        if h:
            print(f"  {r['name']} snapshots ({h['snapshot_bytes']} bytes): hits "
                  + ", ".join(f"{t} {n}" for t, n in h["snapshot_hits"].items())
                  + f"; tokens lost to truncation {h['lost_tokens']}; MB written "
                  + ", ".join(f"{t} {b / 1e6:.3f}" for t, b in h["written_bytes"].items())
                  + "; read " + ", ".join(f"{t} {b / 1e6:.3f}"
                                          for t, b in h["read_bytes"].items()))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(_run, args)


if __name__ == "__main__":
    sys.exit(main())
