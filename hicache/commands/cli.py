"""The ``hicache`` command: check a policy file, plan a topology, run the DCP decode demo."""

from __future__ import annotations

import argparse
import json
import math
import sys

from .. import topology
from ..config import describe, load_config
from ..errors import ConfigError, L3PartialError, RankError, UsageError
from .report import safe_cell, table
from ..companions.draft_format import DraftShape, plan_draft
from ..topology import KVShape

GiB = 1 << 30
# ``plan --shape ...:BYTES``: the KV element type of each size (its bytes: hicache.page_format)
PLAN_DTYPES = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def number(flag: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """A numeric argument that must be finite and in range; else one ``UsageError`` line."""
    if not (isinstance(value, (int, float)) and math.isfinite(value)
            and (lo < value if lo_open else lo <= value) and value <= hi):
        raise UsageError(f"{flag} must be in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}], "
                         f"got {value}")
    return value


def _check_config(args) -> int:
    from .. import preflight
    from ..paths import default_policy
    if args.file is None:
        args.file = str(default_policy())
    cfg = load_config(args.file)
    if args.ranks is not None:
        number("--ranks", args.ranks, 1, 4096)
    machine = preflight.Machine.detect()
    warnings = preflight.validate(cfg, ranks=args.ranks, machine=machine)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    p = cfg.parallel
    per_rank_tokens = cfg.l1_tokens_per_rank
    ranks = p.dcp if args.ranks is None else args.ranks
    need = preflight.memory_need(cfg, ranks, cuda=machine.cuda)
    info = {
        "file": args.file,
        "topology": f"valid: tp {p.tp}, attn_dp {p.attn_dp}, dcp {p.dcp} "
                    f"(max dcp {topology.max_dcp(p.tp, 1, p.attn_dp)})",
        "effective_page_size": cfg.page_tokens,  # the output keeps its name: scripts read it
        "l1_tokens_per_rank": per_rank_tokens,
        "l1_tokens_total": cfg.l1_tokens,
        "l2_pages": cfg.l2_num_pages,
        "l2_tokens_total": cfg.l2_num_pages * cfg.page_tokens,
        "page_bytes_per_rank": cfg.page_bytes_per_rank,
        "page_formats": [f.describe() for f in cfg.formats],
        "host_memory": f"{need.host_total / GiB:.3f} GiB for {ranks} rank(s) on this node "
                       f"({machine.host_available / GiB:.1f} GiB available)",
        "warnings": warnings,
        "policy": cfg.public_dict(),
    }
    info.update(_snapshot_info(cfg))  # hybrid checkpoints: the KDA snapshot pools
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    rows = [(key, cfg.value(key), help_) for key, _default, help_ in describe()]
    print(table(rows, ["key", "value", "meaning"]))
    print()
    for key in ("topology", "effective_page_size", "l1_tokens_per_rank", "l1_tokens_total",
                "l2_pages", "l2_tokens_total", "page_bytes_per_rank", "host_memory"):
        print(f"{key:>22}: {info[key]}")
    for line in info["page_formats"]:
        print(f"{'page format':>22}: {line}")
    if "snapshots" in info:
        print(f"{'snapshots':>22}: {info['snapshots']}")
    return 0


def _snapshot_info(cfg) -> dict:
    """A hybrid checkpoint's KDA state snapshot format and pools per rank (else nothing)."""
    from ..companions.snapshot_format import snapshot_slots, state_bytes
    fmt = cfg.state_format
    if fmt is None:
        return {}
    (n1, n2), (b1, b2) = snapshot_slots(cfg, True), state_bytes(cfg, True)
    return {"snapshot_format": fmt.describe(), "snapshot_bytes": fmt.page_bytes,
            "snapshots": f"{fmt.describe()}; per rank: L1 {n1} snapshots ({b1} bytes), "
                         f"L2 {n2} ({b2} bytes), L3 written once for the DCP group"}


# Hybrid presets (MLA + KDA): the KV shape of the MLA layers only (the striped part) and the
# per-request linear-attention state every rank holds whole. Kimi-Linear-48B-A3B's published
# config.json: 27 layers, full_attn_layers [4, 8, ..., 24, 27] (1-indexed), the other 20 KDA
# (32 heads of 128, short conv 4), MLA kv_lora_rank 512 + rope 64, bf16.
HYBRID_MODELS = {
    "kimi-linear-48b-a3b": dict(
        shape=KVShape("kimi-linear-48b-a3b", 7, "mla", 1, kv_lora_rank=512, rope_dim=64),
        layers=27, mla_layers=(4, 8, 12, 16, 20, 24, 27), kda_heads=32, kda_head_dim=128,
        conv_kernel=4),
}


def _hybrid_info(name: str) -> dict:
    """Which layers are striped, which hold state, and the state's bytes (one request)."""
    h = HYBRID_MODELS[name]
    shape = h["shape"]
    kda = [i for i in range(1, h["layers"] + 1) if i not in h["mla_layers"]]
    d = h["kda_heads"] * h["kda_head_dim"]
    conv = 3 * d * (h["conv_kernel"] - 1) * shape.dtype_bytes  # model dtype
    rec = h["kda_heads"] * h["kda_head_dim"] ** 2 * 4  # fp32
    return {"layers": h["layers"], "striped_mla_layers": list(h["mla_layers"]),
            "state_kda_layers": kda, "kda_state_bytes_per_layer": conv + rec,
            "kda_conv_state_bytes_per_layer": conv, "kda_recurrent_state_bytes_per_layer": rec,
            "snapshot_bytes": len(kda) * (conv + rec),
            # as the cache keeps it (a STATE page: the conv window widened to fp32, exactly)
            "snapshot_cache_bytes": len(kda) * (3 * d * (h["conv_kernel"] - 1) * 4 + rec)}


def _shape_from_args(args) -> KVShape:
    if args.model and args.shape:
        raise UsageError("give --model or --shape, not both")
    if args.model and args.model.lower() in HYBRID_MODELS:
        return HYBRID_MODELS[args.model.lower()]["shape"]
    if args.model:
        return topology.get_model(args.model)
    if not args.shape:
        raise UsageError("give --model NAME or --shape mla:LAYERS:RANK:ROPE[:BYTES] | "
                         "gqa:LAYERS:HEADS:HEAD_DIM[:BYTES]")
    parts = args.shape.split(":")
    try:
        kind, nums = parts[0], [int(x) for x in parts[1:]]
    except ValueError:
        raise UsageError(f"--shape {args.shape!r}: fields after the kind must be integers") from None
    if kind in ("mla", "gqa") and len(nums) in (3, 4):
        size = nums[3] if len(nums) == 4 else 2
        if size not in PLAN_DTYPES:
            raise UsageError(f"--shape {args.shape!r}: BYTES must be one of "
                             f"{', '.join(map(str, PLAN_DTYPES))} (an element of "
                             f"{', '.join(PLAN_DTYPES.values())}), got {size}")
        if kind == "mla":
            return KVShape("custom", nums[0], "mla", 1, kv_lora_rank=nums[1], rope_dim=nums[2],
                           dtype=PLAN_DTYPES[size])
        return KVShape("custom", nums[0], "gqa", nums[1], head_dim=nums[2],
                       dtype=PLAN_DTYPES[size])
    raise UsageError(f"--shape {args.shape!r}: expected mla:LAYERS:RANK:ROPE[:BYTES] or "
                     "gqa:LAYERS:HEADS:HEAD_DIM[:BYTES]")


def _plan(args) -> int:
    shape = _shape_from_args(args)
    if args.fleet:  # the shared L3 store at fleet width (hicache.commands.fleet)
        from . import fleet as fleet_cli
        return fleet_cli.run(args, shape)
    if args.memory is not None:
        number("--memory (GiB)", args.memory, 0, 1 << 30, lo_open=True)
    memory = (args.memory or 0) * GiB
    rows = topology.plan(shape, args.tp, args.attn_dp, memory, args.dcp)
    lo, hi = 1, topology.max_dcp(args.tp, shape.num_kv_heads, args.attn_dp)
    out = {
        "model": shape.name, "tp": args.tp, "attn_dp": args.attn_dp,
        "dcp_range": [lo, hi],
        "duplication_without_dcp": topology.kv_duplication(args.tp, shape.num_kv_heads),
        "memory_gib": args.memory,
        "rows": [{"dcp": r.dcp, "duplication": r.duplication,
                  "kv_bytes_per_token_per_rank": r.kv_bytes_per_token_per_rank,
                  "tokens_in_budget": r.tokens_per_rank_budget} for r in rows],
    }
    hybrid = _hybrid_info(shape.name) if shape.name in HYBRID_MODELS else None
    if hybrid:
        out["hybrid"] = hybrid
    draft = _plan_draft(args, shape)  # spec: the draft's replicated KV, counted per rank
    if draft is not None:
        out["spec"] = {"method": args.spec, "draft_layers": draft.layers,
                       "draft_kv_dim": draft.kv_dim}
        for r in out["rows"]:
            r.update(plan_draft(draft, memory, r["kv_bytes_per_token_per_rank"]))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"model {shape.name}: tp {args.tp}, attn_dp {args.attn_dp}, "
          f"valid dcp in [{lo}, {hi}] (sizes dividing attn_tp)")
    if hybrid:
        print(f"striped (MLA KV, v mod dcp): layers {hybrid['striped_mla_layers']} of "
              f"{hybrid['layers']} (1-indexed)")
        print(f"state (KDA, replicated on every rank, request-indexed): "
              f"{len(hybrid['state_kda_layers'])} layers, "
              f"{hybrid['kda_state_bytes_per_layer']} bytes per layer per request "
              f"(conv {hybrid['kda_conv_state_bytes_per_layer']} + fp32 recurrent "
              f"{hybrid['kda_recurrent_state_bytes_per_layer']}); snapshot "
              f"{hybrid['snapshot_bytes']} bytes")
        print(f"snapshot as cached (STATE page, fp32, one per snapshot position, replicated: "
              f"L1 and L2 on every rank, L3 once per DCP group): "
              f"{hybrid['snapshot_cache_bytes']} bytes")
    headers = ["dcp", "duplication", "KV bytes/token/rank"]
    if memory:
        headers.append(f"tokens in {args.memory:g} GiB/rank")
    if draft is not None:
        headers += ["+draft bytes/token/rank"] + (["tokens with draft"] if memory else [])
    print(table([[r["dcp"], r["duplication"], r["kv_bytes_per_token_per_rank"]]
                 + ([r["tokens_in_budget"]] if memory else [])
                 + ([r["draft_kv_bytes_per_token_per_rank"]] if draft is not None else [])
                 + ([r["tokens_in_budget_with_draft"]] if draft is not None and memory else [])
                 for r in out["rows"]], headers))
    return 0


def _plan_draft(args, shape: KVShape):
    """``plan --spec``: the draft's KV per token (``DraftShape``), None for ``none``. MTP: one
    MLA layer of the target's latent width; a draft model: ``--draft-shape mla:...``."""
    if args.spec == "none":
        if args.draft_shape:
            raise UsageError("--draft-shape needs --spec draft")
        return None
    if args.spec == "mtp":
        if args.draft_shape:
            raise UsageError("--draft-shape needs --spec draft (mtp drafts with the target's "
                             "own MTP layer)")
        if shape.attention != "mla":
            raise UsageError(f"--spec mtp: model {shape.name!r} is not MLA (MTP modules are "
                             "DeepSeek-V3 MLA layers)")
        return DraftShape(1, shape.row_elems_per_head, shape.dtype, shape.dtype_bytes)
    if not args.draft_shape:
        raise UsageError("--spec draft needs --draft-shape mla:LAYERS:RANK:ROPE[:BYTES]")
    d = _shape_from_args(argparse.Namespace(model=None, shape=args.draft_shape))
    if d.attention != "mla":
        raise UsageError(f"--draft-shape {args.draft_shape!r}: the draft must be MLA (mla:...)")
    return DraftShape(d.num_layers, d.row_elems_per_head, d.dtype, d.dtype_bytes)


def _l3_check(args) -> int:
    """Walk an L3 store in a child process (a crash there is a verdict); report one line;
    exit 0 healthy, 1 damaged (moved aside with --quarantine), 2 not a hicache store."""
    import os
    from ..l3 import lmdb_check
    path = args.path
    number("--timeout (seconds)", args.timeout, 0, 86400, lo_open=True)
    if not os.path.isdir(path):
        raise UsageError(f"l3 check: {path!r} is not a directory")
    if not os.path.exists(os.path.join(path, "data.mdb")):
        raise UsageError(f"l3 check: {path!r} holds no LMDB store (no data.mdb)")
    files = None
    if args.secret_file or args.previous_secret_file:  # checked here: one line, exit 2
        from ..l3 import auth
        auth.load(None, env={auth.ENV: args.secret_file or "",
                             auth.ENV_PREVIOUS: args.previous_secret_file or ""})
        files = (args.secret_file or "", args.previous_secret_file or "")
    report = lmdb_check.check_in_child(path, timeout_s=args.timeout, secret_files=files)
    if report.get("usage"):
        raise UsageError(report["error"])
    if report.get("foreign"):
        raise UsageError(report["error"])
    if report.get("ok"):
        line = (f"{path}: ok: {report.get('values', 0)} values, records per sub-database "
                f"{report.get('entries', {})}")
        if report.get("unverified"):
            line += (f"; {report['unverified']} authenticated values not verified (give "
                     "--secret-file)")
        elif report.get("mac_verified"):
            line += "; MACs verified"
    elif report.get("wrong_secret"):  # not damage: never quarantined
        print(json.dumps(report) if args.json else
              f"{path}: every MAC fails ({report['mac_failures']} of {report['mac_values']} "
              "authenticated values): the secret is likely wrong (not the one that wrote this "
              "store); nothing was quarantined")
        return 2
    else:
        what = report.get("error") or (f"{report.get('bad_values')} of {report.get('values')} "
                                       "values fail their checksum or MAC")
        line = f"{path}: DAMAGED: {what}"
        if args.quarantine:
            report["quarantined_to"] = lmdb_check.quarantine(path)
            line += f"; moved to {report['quarantined_to']}"
        else:
            line += "; --quarantine moves it aside"
    print(json.dumps(report) if args.json else line)
    return 0 if report.get("ok") else 1


def _l3_where(args, what: str):
    """The store an ``l3 ls`` / ``l3 purge`` names: ``--url URL[,URL...]`` (a backend that
    claims URLs) or an LMDB directory that holds a store; UsageError (exit 2) otherwise."""
    import os
    from ..l3 import registry
    if (args.url is None) == (args.path is None):
        raise UsageError(f"l3 {what}: give a store: --url URL (Redis / Valkey) or an LMDB PATH")
    if args.url is not None:
        urls = [u.strip() for u in args.url.split(",") if u.strip()]
        where = urls if len(urls) > 1 else (urls[0] if urls else "")
        b = registry.for_where(where) if where else None
        if b is None or not b.claims(where) or b.name == registry.DEFAULT:
            raise UsageError(f"l3 {what}: --url {args.url!r} is not a URL that a registered "
                             f"L3 backend ({', '.join(registry.names())}) takes")
        return where
    if not os.path.isdir(args.path) or not os.path.exists(os.path.join(args.path, "data.mdb")):
        raise UsageError(f"l3 {what}: {args.path!r} holds no LMDB store (no data.mdb)")
    return args.path


def _l3_ls(args) -> int:
    """List the namespaces of an L3 store: model, layout, ranks, keys, bytes."""
    from ..l3 import registry
    try:
        rows, partial = registry.namespaces(_l3_where(args, "ls")), None
    except L3PartialError as e:  # a cluster node is down: what the others hold, and exit 3
        rows, partial = e.partial, e
    if args.json:
        print(json.dumps([r.as_dict() for r in rows]))
    elif not rows:
        print("no namespaces")
    else:  # records are written by anyone with write access: escaped and cut for a terminal
        print(table([[r.digest, safe_cell(r.model), safe_cell(r.layout),
                      safe_cell(",".join(map(str, r.ranks))), r.keys, r.bytes] for r in rows],
                    ["namespace", "model", "layout", "ranks", "keys", "bytes"]))
    return _partial(partial)


def _partial(e) -> int:
    """0, or (a store only partly reachable) its one line on stderr and exit 3."""
    if e is None:
        return 0
    print(f"error: {e}", file=sys.stderr)
    return 3


def _l3_purge(args) -> int:
    """Delete one namespace (every rank's pages and its record); nothing interactive."""
    from ..l3 import registry
    try:
        gone, partial = registry.purge(_l3_where(args, "purge"), args.namespace), None
    except L3PartialError as e:  # a cluster node is down: what the others deleted, and exit 3
        gone, partial = e.partial, e
    if args.json:
        print(json.dumps(gone.as_dict()))
    else:
        print(f"deleted namespace {gone.digest} ({safe_cell(gone.model)}, "
              f"{safe_cell(gone.layout)}): {gone.keys} keys, {gone.bytes} bytes freed")
    return _partial(partial)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check-config", help="validate a policy file and print what it resolves to")
    c.add_argument("file", nargs="?", default=None,
                   help="policy file (default: the example policy shipped with hicache)")
    c.add_argument("--json", action="store_true")
    c.add_argument("--ranks", type=int, default=None,
                   help="ranks sharing this node's memory (default parallel.dcp, as "
                        "hicache-bench spawns)")
    c.set_defaults(func=_check_config)
    p = sub.add_parser("plan", help="KV duplication, valid DCP sizes and capacity for a model")
    p.add_argument("--model", help=f"one of {', '.join(sorted([*topology.MODELS, *HYBRID_MODELS]))}")
    p.add_argument("--shape", help="mla:LAYERS:RANK:ROPE[:BYTES] or gqa:LAYERS:HEADS:DIM[:BYTES]")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--attn-dp", type=int, default=1)
    p.add_argument("--dcp", type=int, default=None, help="show only dcp 1 and this size")
    p.add_argument("--memory", type=float, default=None, help="KV memory per rank in GiB")
    p.add_argument("--spec", default="none", choices=("none", "mtp", "draft"),
                   help="count a speculative draft's replicated KV (mtp: the target's MTP "
                        "layer; draft: --draft-shape)")
    p.add_argument("--draft-shape", help="--spec draft: mla:LAYERS:RANK:ROPE[:BYTES]")
    p.add_argument("--json", action="store_true")
    from . import fleet as fleet_cli
    fleet_cli.add_args(p)
    p.set_defaults(func=_plan)
    l3 = sub.add_parser("l3", help="L3 store maintenance").add_subparsers(dest="l3_command",
                                                                         required=True)
    k = l3.add_parser("check", help="walk an L3 store (in a child process) and report damage")
    k.add_argument("path")
    k.add_argument("--quarantine", action="store_true",
                   help="move a damaged store aside (PATH.damaged-<time>)")
    k.add_argument("--timeout", type=float, default=600.0, help="seconds the walk may take")
    k.add_argument("--secret-file", default=None,
                   help="fleet secret: verify the MAC of authenticated values (default "
                        "$HICACHE_L3_SECRET_FILE; without one they are counted as unverified)")
    k.add_argument("--previous-secret-file", default=None,
                   help="the secret before a rotation (its MACs are accepted too)")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=_l3_check)
    for name, func, help_ in (
            ("ls", _l3_ls, "list an L3 store's namespaces (model, layout, ranks, keys, bytes)"),
            ("purge", _l3_purge, "delete one namespace of an L3 store (prints what it deleted)")):
        c = l3.add_parser(name, help=help_)
        c.add_argument("path", nargs="?", default=None, help="an LMDB store's directory")
        c.add_argument("--url", default=None,
                       help="a Redis / Valkey store: redis://host:port/db, rediss://..., "
                            "unix:///path.sock, or cluster node URLs joined by commas")
        if name == "purge":
            c.add_argument("--namespace", required=True,
                           help="the namespace `hicache l3 ls` prints (or a unique prefix of "
                                "8+ hex digits)")
        c.add_argument("--json", action="store_true")
        c.set_defaults(func=func)
    from . import decode as engine_cli
    engine_cli.add_parser(sub)
    from ..replay import command as replay_command
    replay_command.add_parser(sub)
    return parser


USER_ERRORS = (ConfigError, UsageError)  # TopologyError is a ConfigError


def _user_error(e: BaseException | None) -> bool:
    return isinstance(e, USER_ERRORS) or (isinstance(e, ValueError)
                                          and type(e).__module__.startswith("hicache"))


def run_guarded(func, args) -> int:
    """Run a command; a user error prints one line and exits 2, never a traceback. A rank that
    fails or dies is one line naming the rank and how (exit 1; ``HICACHE_DEBUG=1`` adds that
    rank's traceback)."""
    import os
    try:
        return func(args)
    except RankError as e:
        if _user_error(e.cause):
            print(f"error: rank {e.rank}: {e.cause}", file=sys.stderr)
            return 2
        if e.detail and os.environ.get("HICACHE_DEBUG"):
            print(e.detail, file=sys.stderr, end="")
        hint = " (HICACHE_DEBUG=1 shows its traceback)" if e.detail else ""
        print(f"error: {e}{hint}; the other ranks were stopped", file=sys.stderr)
        return 1
    except ValueError as e:  # ours, and other libraries' bad-input errors (argument values)
        if _user_error(e):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = run_guarded(args.func, args)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:  # `hicache ... | head`: the reader left; end quietly
        quiet_stdout()
        return 141  # 128 + SIGPIPE, as a tool killed by the closed pipe


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush into a closed pipe says
    nothing."""
    import os
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
