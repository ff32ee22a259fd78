"""The fault-injection soak behind ``hicache-bench --duration S --faults SEED``.

Each rank (2+, real processes) first serves the trace once in recompute mode: the reference
tokens. Then, with a seeded :class:`hicache.faults.FaultInjector` installed, it replays the trace
in batches on ``l1+l2+l3`` until rank 0's clock passes ``S`` (decided for all ranks at once):

- every token emitted is compared with the reference token of that request;
- a failed device copy raises ``TransferError`` on every rank at the same step: the rank closes
  the service, starts a fresh one on the same L3 store and re-runs the batch's unfinished
  requests (counted: ``service_restarts``; the step of each failure is compared across ranks);
- after every batch (a quiet point: no request active, transfers drained) pages not held by the
  cache tree, open locks and resident memory are sampled;
- collectives run on a group with a bounded timeout, so a hang ends the rank with an error that
  is counted in ``hung_collectives`` instead of stalling the run.

The L3 store is the soak's own (faults corrupt and delete values in it): a fresh temporary LMDB
directory, or, when the policy's ``l3.backend`` is ``redis``, a private Redis/Valkey server the
soak starts by PID (never the configured one, append-only file on); with Redis the server is
also killed by PID (SIGKILL) and restarted while the ranks run (``l3_restart``).
"""

from __future__ import annotations

import datetime
import gc
import os
import shutil
import signal
import tempfile
import time
from dataclasses import replace

from .bench_model import engine_model, l3_backend
from ..config import HiCacheConfig
from ..errors import TransferError
from ..faults import FaultConfig, FaultInjector, KINDS, L3_KINDS, OPT_IN
from ..kvcheck import Comparison, KVProbe, compare

MARGIN_S = 30.0          # the soak ends within --duration plus this (one batch, a last drain)
COLLECTIVE_TIMEOUT_S = 60.0
BATCH = 8                # requests between two quiet points
RSS_SLACK = 64 << 20     # resident memory may grow this much (+10%) once warm


def run_soak_rank(rank: int, world: int, cfg_dict: dict, jobs: list, opts: dict) -> dict:
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    cfg = HiCacheConfig.from_dict(cfg_dict)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(
        seconds=opts.get("collective_timeout_s", COLLECTIVE_TIMEOUT_S)))
    model = engine_model(cfg, seed=opts["seed"])  # [model] path, or the built-in seeded model
    return _RankSoak(rank, world, cfg, group, model, opts).run(jobs)


# the metrics' counters summed in a rank's report: report key -> metric name
_TOTALS = (("hit_tokens", "hicache_hit_tokens_total"), ("prefetch", "hicache_prefetch_total"),
           ("failed_copies", "hicache_failed_copies_total"),
           ("l3_errors", "hicache_l3_failures_total"), ("bytes", "hicache_transfer_bytes_total"))


class _RankSoak:
    """One rank's soak: the recompute reference, then faulted batches until rank 0's clock
    says stop. ``out`` is what the rank reports (see ``verdict``)."""

    def __init__(self, rank: int, world: int, cfg: HiCacheConfig, group, model,
                 opts: dict) -> None:
        self.rank, self.world, self.cfg, self.group, self.model = rank, world, cfg, group, model
        self.opts = opts
        self.sig = model.weights_signature()  # the built-in model's digest names its weights
        self.kv = Comparison()

    def server(self, cache, probe=None):
        from ..serving import Server
        o = self.opts
        return Server(self.model, cache, group=self.group, backend=o["backend"],
                      chunk_tokens=o["chunk"], max_running=o["max_running"], probe=probe)

    def reference(self, jobs: list) -> None:
        """Recompute's tokens of every request, the rows of every prompt page and the
        first-token logits (hicache.kvcheck)."""
        from ..service import HiCache
        with HiCache(self.cfg, self.rank, self.group, mode="recompute") as ref_cache:
            self.model.to(ref_cache.kv.device)  # the engine computes where its KV port lives
            probe = KVProbe(ref_cache.kv, ref_cache.page_tokens, all_pages=True)
            self.ref = {r.request_id: r.output for r in self.server(ref_cache, probe).run(jobs)}
        self.ref_kv = probe.result()

    def arm(self) -> None:
        """The seeded injector (with the shared L3 server it kills, if any), the metrics, the
        rank's report."""
        import psutil

        from ..metrics import HiCacheMetrics
        opts = self.opts
        every = opts.get("fault_every", 40)
        self.l3srv = SharedServer(**opts["server"]) if opts.get("server") else None
        kinds = tuple(opts.get("fault_kinds") or FaultConfig(0).kinds) + (
            ("l3_restart",) if self.l3srv else ())
        self.inj = FaultInjector(FaultConfig(opts["faults"], gap_steps=(max(1, every // 2),
                                                                        max(1, every * 3 // 2)),
                                             kinds=kinds), self.rank, self.world,
                                 server=self.l3srv)
        self.metrics = HiCacheMetrics(rank=self.rank)
        if opts.get("metrics_port"):
            self.metrics.serve(opts["metrics_port"] + self.rank)
        self.proc = psutil.Process()
        self.out = {"rank": self.rank, "wrong_tokens": 0, "completed": 0, "restarts": 0,
                    "failures": [], "quiet": [], "hung": 0, "error": None, "corrupt": 0,
                    "outputs_checked": 0}

    def fresh(self) -> None:
        """A new service on the soak's L3 store, faults installed, and its server."""
        from ..service import HiCache
        self.cache = HiCache(self.cfg, self.rank, self.group, mode="l1+l2+l3",
                             weights_signature=self.sig)
        self.inj.install(self.cache)
        self.metrics.attach(self.cache)
        self.srv = self.server(self.cache, KVProbe(self.cache.kv, self.cache.page_tokens))

    def compared(self) -> None:
        """The rows and logits the server's requests were served, against the reference."""
        probe = self.srv.probe
        self.kv.add(compare(self.ref_kv, probe.result(), key=lambda rid: rid[1]))
        probe.pages.clear()
        probe.logits.clear()

    def retire(self) -> None:
        # a batch that failed is not compared: what a failed copy left in its pages was
        # agreed as a failure, and no token computed from it was returned
        self.srv.probe.pages.clear()
        self.srv.probe.logits.clear()
        self.metrics.detach()
        self.out["corrupt"] += self.cache.stats()["corrupt"]
        self.cache.close(flush=False)
        gc.collect()  # the injector's wrappers make a cycle through the cache: free its pools

    def done(self, r, pending: dict) -> None:
        """A request returned: its tokens against the reference."""
        out = self.out
        pending.pop(r.request_id, None)
        want = self.ref[r.request_id[1]]
        out["wrong_tokens"] += sum(a != b for a, b in zip(r.output, want)) + abs(
            len(r.output) - len(want))
        out["completed"] += 1
        out["outputs_checked"] += len(r.output)

    def serve_batch(self, pending: dict) -> None:
        """Serve ``pending`` to a quiet point. A failed copy raises on every rank at the same
        step: the service restarts and re-runs the requests that did not finish."""
        while True:
            try:
                if pending:
                    self.srv.run(list(pending.values()),
                                 on_done=lambda r: self.done(r, pending))
                self.cache.drain()  # a quiet point: nothing active, transfers applied
                self.compared()
                return
            except TransferError as e:  # raised on every rank at the same step
                self.out["failures"].append((self.inj.steps, _first_line(e)))
                self.out["restarts"] += 1
                self.retire()
                self.fresh()

    def run(self, jobs: list) -> dict:
        from ..distributed import rank0_decides  # (rank 0's clock decides for every rank)
        self.reference(jobs)
        self.arm()
        out = self.out
        self.fresh()
        batches = [jobs[i:i + BATCH] for i in range(0, len(jobs), BATCH)]
        t0 = time.monotonic()
        n = 0
        try:
            while rank0_decides(time.monotonic() - t0 < self.opts["duration"], self.group):
                pending = {j.request_id: j for j in (replace(j, request_id=(n, j.request_id))
                                                     for j in batches[n % len(batches)])}
                n += 1
                self.serve_batch(pending)
                out["quiet"].append(_quiet_point(self.cache, self.proc.memory_info().rss))
            soak_s = time.monotonic() - t0
            self.retire()
            self.inj.close()
        except RuntimeError as e:  # a collective that timed out: counted, the run stops here
            if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                raise
            out["hung"] += 1
            out["error"] = _first_line(e)
            soak_s = time.monotonic() - t0
        finally:
            # the metrics' counters run on across restarts: the whole soak's figures
            vals = self.metrics.values()
            out["totals"] = {key: {lab: v for (name, lab), v in vals.items() if name == metric}
                             for key, metric in _TOTALS}
            self.metrics.close()
        out.update(soak_s=soak_s, batches=n, faults=self.inj.report(), plan=self.inj.events,
                   kv=self.kv.as_dict())
        if self.l3srv is not None:
            out["server"] = True
        return out


def _first_line(e: BaseException) -> str:
    return ((str(e) or repr(e)).splitlines() or [repr(e)])[0][:300]


def _quiet_point(cache, rss: int) -> dict:
    """Pages of each tier not held by the cache tree, and open locks (both 0 when nothing
    leaked), pages used, resident memory."""
    leaks = cache.leaks()
    s = cache.stats()
    return {"leaked_pages": {"l1": leaks["l1"], "l2": leaks["l2"]},
            "leaked_locks": leaks["locks"],
            "pages": dict(s["pages"]), "rss": rss}


class SharedServer:
    """The soak's Redis/Valkey server as every rank sees it: started and killed by the PID kept
    in ``dir/pid`` (a rank may kill a server another rank restarted)."""

    def __init__(self, dir: str, port: int, maxmemory: int) -> None:
        self.dir, self.port, self.maxmemory = dir, port, maxmemory
        self._local = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        from ..l3.localserver import LocalServer
        # append-only file: a restarted server comes back with what it had (but the last ~1 s)
        self._local = LocalServer(self.dir, port=self.port, maxmemory=self.maxmemory,
                                  extra=("--appendonly", "yes", "--appendfsync", "everysec")
                                  ).start()
        with open(os.path.join(self.dir, "pid"), "w") as f:
            f.write(str(self._local.pid))

    def kill(self) -> None:
        from ..l3.localserver import _ping
        try:
            pid = int(open(os.path.join(self.dir, "pid")).read())
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            return  # already gone
        deadline = time.monotonic() + 10
        while _ping(self.port, None, 0.2) and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._local is not None and self._local.proc is not None:
            self._local.proc.poll()  # reap it when this rank started it


# ---- the parent ------------------------------------------------------------------------------
def run_soak(cfg: HiCacheConfig, jobs: list, opts: dict) -> dict:
    """Spawn the ranks, run the soak, return the ``"faults"`` report (see ``verdict``)."""
    from ..distributed import launch
    l3 = tempfile.mkdtemp(prefix="hicache-soak-l3-")
    server = None
    try:
        backend = l3_backend(cfg)
        if backend.shared:  # a server the ranks share: started (and killed) here
            from ..l3.localserver import free_port
            server = SharedServer(l3, free_port(), 256 << 20)
            server.start()
            opts = dict(opts, server={"dir": l3, "port": server.port,
                                      "maxmemory": server.maxmemory})
            cfg = cfg.replace(l3={"enabled": True, backend.name: {
                **backend.section_of(server.url), "timeout_s": 0.5}})
        else:
            cfg = cfg.replace(l3={"enabled": True, backend.name: backend.section_of(l3)})
        t0 = time.monotonic()
        try:
            ranks = launch(cfg.parallel.dcp, run_soak_rank, cfg.to_dict(), jobs, opts,
                           timeout_s=opts["duration"] + 600)
        except RuntimeError as e:  # a rank died or never returned: the soak failed
            return {"error": str(e)[-2000:], "hung_collectives": int("timed out" in str(e)),
                    "wall_s": time.monotonic() - t0}
        f = verdict(ranks, opts["duration"], time.monotonic() - t0, opts["faults"])
        f["l3_backend"] = cfg.l3.backend
        return f
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(l3, ignore_errors=True)


def _injected(ranks: list[dict]) -> dict:
    """Faults injected per kind over the ranks: every default kind (0 when none took effect),
    and the opt-in kinds that were planned (``l3_restart`` when the soak had a server)."""
    planned = {k for r in ranks for k in r["faults"]["planned"]}
    injected: dict = {k: 0 for k in KINDS
                      if k not in OPT_IN or k in planned or (k == "l3_restart"
                                                            and "server" in ranks[0])}
    for r in ranks:
        for k, v in r["faults"]["injected"].items():
            injected[k] += v
    return injected


def _rss_warm_last(ranks: list[dict]) -> list[list[int]]:
    """Resident MiB per rank once warm (the third quiet point) and at the last one."""
    rss = []
    for r in ranks:
        q = r["quiet"]
        warm = q[min(2, len(q) - 1)]["rss"] if q else 0
        rss.append([warm >> 20, (q[-1]["rss"] >> 20) if q else 0])
    return rss


def _kv_figures(ranks: list[dict]) -> dict:
    """The served KV rows and first-token logits against recompute's, over the ranks."""
    kv = Comparison()
    for r in ranks:
        kv.add(Comparison(**r["kv"]))
    return dict(kv_pages_checked=kv.pages, kv_pages_bit_identical=kv.bitwise,
                kv_max_abs_diff=kv.kv_max_abs_diff, kv_corrupt_pages=kv.bad_pages,
                logits_checked=kv.requests, logits_max_abs_diff=kv.logits_max_abs_diff,
                logits_differ=kv.bad_logits)


def verdict(ranks: list[dict], duration: float, wall_s: float, seed: int) -> dict:
    injected = _injected(ranks)
    leaked_pages = max((sum(q["leaked_pages"].values()) for r in ranks for q in r["quiet"]),
                       default=0)
    leaked_locks = max((q["leaked_locks"] for r in ranks for q in r["quiet"]), default=0)
    steps = [[f[0] for f in r["failures"]] for r in ranks]
    rss = _rss_warm_last(ranks)
    rss_flat = all(last <= warm * 1.1 + (RSS_SLACK >> 20) for warm, last in rss)
    soak_s = max(r["soak_s"] for r in ranks)
    f = {
        "seed": seed,
        "injected": injected,
        "wrong_tokens": sum(r["wrong_tokens"] for r in ranks),
        "hung_collectives": sum(r["hung"] for r in ranks),
        "leaked_pages": leaked_pages,
        "leaked_locks": leaked_locks,
        "service_restarts": ranks[0]["restarts"],
        "failures_agreed": all(s == steps[0] for s in steps) and all(
            r["restarts"] == ranks[0]["restarts"] for r in ranks),
        "failure_errors": [[m for _s, m in r["failures"]] for r in ranks],
        "l3_misses_from_faults": sum(r["faults"]["l3_misses"] for r in ranks)
        + sum(r["corrupt"] for r in ranks),
        "l3_corrupt_detected": sum(r["corrupt"] for r in ranks),
        "hit_tokens": {t: sum(r["totals"]["hit_tokens"].get(t, 0) for r in ranks)
                       for t in ("l1", "l2", "l3")},
        "prefetch": {o: sum(r["totals"]["prefetch"].get(o, 0) for r in ranks)
                     for o in ranks[0]["totals"]["prefetch"]},
        # the store was unavailable (value failures are counted as corrupt above)
        "l3_errors": sum(v for r in ranks for k, v in r["totals"]["l3_errors"].items()
                         if k not in ("corrupt", "auth")),
        "bytes": {d: sum(r["totals"]["bytes"].get(d, 0) for r in ranks)
                  for d in ranks[0]["totals"]["bytes"]},
        "requests_completed": ranks[0]["completed"],
        "tokens_checked": ranks[0]["outputs_checked"],
        "batches": ranks[0]["batches"],
        "soak_s": soak_s,
        "deadline_s": duration + MARGIN_S,
        "wall_s": wall_s,
        "rss_mib": rss,
        "rss_mib_series": [_sampled([q["rss"] >> 20 for q in r["quiet"]]) for r in ranks],
        "rss_flat": rss_flat,
        "errors": [r["error"] for r in ranks if r["error"]],
    }
    f.update(_kv_figures(ranks))
    f["problems"] = problems(f)
    f["notes"] = notes(f)
    return f


def _sampled(xs: list, n: int = 16) -> list:
    """At most ``n`` evenly spaced values of ``xs`` (its last one included)."""
    if len(xs) <= n:
        return xs
    return [xs[round(i * (len(xs) - 1) / (n - 1))] for i in range(n)]


def problems(f: dict) -> list[str]:
    """What makes the soak fail (empty: it passed)."""
    out = []
    if f.get("error"):
        return [f"a rank failed: {f['error'].splitlines()[-1]}"]
    if f["wrong_tokens"]:
        out.append(f"{f['wrong_tokens']} emitted tokens differ from recompute")
    if f.get("kv_corrupt_pages") or f.get("logits_differ"):
        out.append(f"served KV differs from recompute's rows: {f['kv_corrupt_pages']} of "
                   f"{f['kv_pages_checked']} pages (max |diff| {f['kv_max_abs_diff']:.3g}), "
                   f"first-token logits of {f['logits_differ']} requests (max |diff| "
                   f"{f['logits_max_abs_diff']:.3g})")
    if f["hung_collectives"]:
        out.append(f"{f['hung_collectives']} collectives timed out")
    if f["leaked_pages"] or f["leaked_locks"]:
        out.append(f"leak at a quiet point: {f['leaked_pages']} pages, {f['leaked_locks']} locks")
    if not f["failures_agreed"]:
        out.append("ranks stopped at different steps after a failed copy")
    if f["soak_s"] > f["deadline_s"]:
        out.append(f"the soak ran {f['soak_s']:.1f} s, past its deadline {f['deadline_s']:.0f} s")
    if not f["rss_flat"]:
        out.append(f"resident memory grew once warm: {f['rss_mib']} MiB")
    if not f["requests_completed"]:
        out.append("no request completed")
    return out


def notes(f: dict) -> list[str]:
    """What makes the soak weaker than it looks (printed, not a failure)."""
    out = []
    if f.get("hit_tokens", {}).get("l3", 0) == 0:
        out.append("no L3 hit: L1/L2 hold the whole trace, so L3 faults were never on a read "
                   "path (raise --scale or shrink l1.num_pages)")
    if not f.get("injected", {}).get("d2h_fail"):
        out.append("no copy failure took effect (no D2H copy ran after one was armed)")
    return out


def table_rows(f: dict) -> list[list]:
    rows = [[f"injected {k}", v] for k, v in f["injected"].items()]
    rows += [[k, f[k]] for k in ("wrong_tokens", "hung_collectives", "leaked_pages",
                                 "leaked_locks", "service_restarts", "failures_agreed",
                                 "l3_misses_from_faults", "l3_corrupt_detected",
                                 "requests_completed",
                                 "tokens_checked", "kv_pages_checked",
                                 "kv_pages_bit_identical", "kv_corrupt_pages",
                                 "logits_checked", "logits_differ")]
    rows += [["kv max |diff| (projected rows)", f"{f.get('kv_max_abs_diff', 0.0):.3g}"],
             ["first-token logits max |diff|", f"{f.get('logits_max_abs_diff', 0.0):.3g}"]]
    rows += [["hit tokens l1/l2/l3 (all ranks)", "/".join(str(int(v)) for v in
                                                        f["hit_tokens"].values())],
             ["l3 errors (store unavailable)", int(f["l3_errors"])],
             ["prefetch outcomes", ", ".join(f"{k} {int(v)}" for k, v in f["prefetch"].items()
                                             if v)],
             ["soak s (deadline)", f"{f['soak_s']:.1f} ({f['deadline_s']:.0f})"],
             ["rss MiB warm->last", ", ".join(f"{a}->{b}" for a, b in f["rss_mib"])]]
    return rows


__all__ = ["run_soak", "run_soak_rank", "verdict", "problems", "table_rows", "L3_KINDS"]
