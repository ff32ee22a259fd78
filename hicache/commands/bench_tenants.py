"""``hicache-bench`` for tenants and routers: ``--scope NAME`` (every request of the run in one
cache scope), ``--scopes N`` (the trace's conversations spread over N scopes), ``--public-prefix``
(each request's shared preamble declared public: matched and cached in the shared scope), and
``--kv-events ENDPOINT`` (the run's KV events published there). Each mode's JSON gains
``scopes``: per scope, its requests, prompt tokens and hit tokens by tier."""

from __future__ import annotations

import argparse
from dataclasses import replace

from .cli import number
from ..config import HiCacheConfig
from ..errors import UsageError

SHARED = "(shared)"  # the shared scope's row in the report


def add_tenant_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tenants and routers")
    g.add_argument("--scope", metavar="NAME", help="admit every request in this cache scope "
                   "(two scopes never share a cached page)")
    g.add_argument("--scopes", type=int, metavar="N", help="spread the conversations over N "
                   "scopes (scope-0 .. scope-N-1, by conversation)")
    g.add_argument("--public-prefix", action="store_true", help="declare each request's "
                   "shared preamble (system prompt, tool preamble, a trace's prefix_len) "
                   "public: cached once for every scope")
    g.add_argument("--kv-events", metavar="ENDPOINT", help="publish KV events in vLLM's wire "
                   "format there (tcp://HOST:PORT connects, tcp://*:PORT binds; overrides "
                   "[events] endpoint)")


def check_tenant_options(args) -> None:
    """Exit-2 errors for the tenant flags (before anything runs)."""
    if args.scope is not None and args.scopes is not None:
        raise UsageError("--scope and --scopes both given; give one")
    if args.scope is not None and not args.scope.strip():
        raise UsageError("--scope: empty; give a scope name")
    if args.scopes is not None:
        number("--scopes", args.scopes, 1, 1 << 20)
    if args.public_prefix and args.scope is None and args.scopes is None:
        raise UsageError("--public-prefix: needs --scope or --scopes (without a scope every "
                         "prefix is shared already)")


def with_events(args, cfg: HiCacheConfig) -> HiCacheConfig:
    """The policy with ``--kv-events`` as its ``[events] endpoint`` (ConfigError if bad)."""
    if args.kv_events is None:
        return cfg
    return cfg.replace(events={"endpoint": args.kv_events})


def apply_scopes(args, jobs: list) -> list:
    """The jobs with their scope (and public tokens) as the flags ask."""
    if args.scope is None and args.scopes is None:
        return jobs
    out = []
    for j in jobs:
        scope = args.scope if args.scope is not None else f"scope-{j.session % args.scopes}"
        out.append(replace(j, scope=scope,
                           public_tokens=j.shared_len if args.public_prefix else 0))
    return out


def scope_report(rows: list[dict], jobs: list) -> None:
    """Each mode's ``scopes``: {scope: {requests, prompt_tokens, hit_tokens by tier}} from its
    per-request hits (the shared scope as ``(shared)``)."""
    scope_of = {str(j.request_id): (j.scope if j.scope is not None else SHARED) for j in jobs}
    for row in rows:
        per: dict = {}
        for r in row.get("requests", []):
            s = per.setdefault(scope_of.get(r["id"], SHARED),
                               {"requests": 0, "prompt_tokens": 0,
                                "hit_tokens": {"l1": 0, "l2": 0, "l3": 0}})
            s["requests"] += 1
            s["prompt_tokens"] += r["prompt_tokens"]
            for t in ("l1", "l2", "l3"):
                s["hit_tokens"][t] += r["hit_tokens"][t]
        row["scopes"] = dict(sorted(per.items()))


def scope_lines(rows: list[dict]) -> list[str]:
    """One line per mode and scope, when the run had scopes."""
    out = []
    for row in rows:
        scopes = row.get("scopes", {})
        if list(scopes) in ([], [SHARED]):
            continue
        for name, s in scopes.items():
            h = s["hit_tokens"]
            out.append(f"  {row['name']} scope {name}: {s['requests']} requests, hit tokens "
                       f"l1 {h['l1']}, l2 {h['l2']}, l3 {h['l3']} of {s['prompt_tokens']}")
    return out
