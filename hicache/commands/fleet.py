"""``hicache plan --fleet``: the fleet model (:mod:`hicache.fleet_model`) for a model at a TP /
DCP, as a table or JSON."""

from __future__ import annotations

import json
import math

from ..errors import UsageError
from ..fleet_model import FleetInputs, plan
from .report import table
from ..topology import KVShape


def add_args(p) -> None:
    """The ``plan`` flags of the fleet model."""
    p.add_argument("--fleet", action="store_true",
                   help="the shared L3 store at fleet width (docs/fleet.md): L3 bytes per "
                        "request, store GB/s per node and fleet, when the store bounds TTFT")
    p.add_argument("--prompt-tokens", type=int, default=8192, help="--fleet: mean prompt")
    p.add_argument("--hit-ratio", type=float, default=0.5,
                   help="--fleet: fraction of prompt tokens restored from L3")
    p.add_argument("--rate", type=float, default=1.0, help="--fleet: requests/s per node")
    p.add_argument("--nodes", type=int, default=1, help="--fleet: serving nodes (TP groups)")
    p.add_argument("--prefill-tps", type=float, default=20000.0,
                   help="--fleet: prefill tokens/s of one node")
    p.add_argument("--process-gbs", type=float, default=1.0,
                   help="--fleet: one rank's store get GB/s (bench/l3.py --fleet 1)")
    p.add_argument("--store-gbs", type=float, default=0.0,
                   help="--fleet: the store's aggregate GB/s (0: unbounded)")


def _rows(inputs: FleetInputs) -> list[list]:
    p = plan(inputs)
    mb = 1e6
    return [
        ["KV bytes/token/rank", f"{p.bytes_per_token_per_rank:.0f}"],
        ["L3 read MB/request/rank", f"{p.read_bytes_per_request_per_rank / mb:.1f}"],
        ["L3 read MB/request/node", f"{p.read_bytes_per_request_per_node / mb:.1f}"],
        ["L3 write MB/request/node", f"{p.write_bytes_per_request_per_node / mb:.1f}"],
        ["store GB/s per node", f"{p.node_gbs:.3f}"],
        ["store GB/s per rank (read)", f"{p.process_gbs_needed:.3f}"],
        ["store GB/s fleet", f"{p.aggregate_gbs:.2f}"],
        ["load s (hit KV)", f"{p.load_s:.3f}"],
        ["prefill s (misses)", f"{p.compute_s:.3f}"],
        ["TTFT bound", "store" if p.store_bound else "prefill"],
        ["store bounds TTFT above hit ratio", f"{p.store_bound_hit_ratio:.3f}"],
        ["break-even GB/s per rank", f"{p.breakeven_process_gbs:.3f}"],
        ["nodes the store serves", "unbounded" if math.isinf(p.max_nodes)
         else f"{p.max_nodes:.1f}"],
    ]


def run(args, shape: KVShape) -> int:
    """Print the fleet plan of ``shape`` at ``--tp`` / ``--dcp`` (default 1)."""
    try:
        inputs = FleetInputs(shape, args.tp, args.dcp or 1, args.prompt_tokens, args.hit_ratio,
                             args.rate, args.nodes, args.prefill_tps, args.process_gbs,
                             args.store_gbs)
    except (TypeError, ValueError) as e:
        raise UsageError(f"plan --fleet: {e}") from None
    p = plan(inputs)
    if args.json:
        out = {"model": shape.name, "tp": args.tp, "dcp": inputs.dcp,
               "inputs": {k: v for k, v in vars(inputs).items() if k != "shape"},
               "fleet": {k: (None if isinstance(v, float) and math.isinf(v) else v)
                         for k, v in p.to_dict().items()}}
        print(json.dumps(out, indent=2))
        return 0
    print(f"fleet: {shape.name}, tp {args.tp}, dcp {inputs.dcp}; {inputs.nodes} node(s) at "
          f"{inputs.requests_per_s:g} req/s, {inputs.prompt_tokens} prompt tokens, hit ratio "
          f"{inputs.hit_ratio:g}; {inputs.process_gbs:g} GB/s per rank, store "
          f"{inputs.store_gbs or 'unbounded'} GB/s")
    print(table(_rows(inputs), ["figure", "value"]))
    return 0
