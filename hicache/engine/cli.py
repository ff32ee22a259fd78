"""``hicache decode``: spawn a DCP group of gloo processes, prefill a seeded prompt, decode.

    hicache decode --dcp C --backend a2a|ag_rs [--replicate-q] --prompt-len N --new-tokens K
                   --seed S [--page-size P] [--model FILE] [--device cpu|cuda] [--verify]
                   [--json]

Prints the token ids, per-rank KV rows and bytes, DCP collectives per layer and the mean decode
step time; ``--json`` prints one object with ``tokens``, ``kv_rows_per_rank``,
``kv_bytes_per_rank``, ``collectives_per_layer``, ``step_time_s`` (and a few extras). ``--verify``
also runs the dense single-process reference and fails (exit 1) when the tokens differ.

``add_parser(subparsers)`` adds the subcommand; ``run(args) -> int`` runs it and raises
``DecodeArgsError`` (one clear line, exit 2 in the caller) for bad arguments. ``decode_worker`` is
the per-rank body, reused by bench/decode.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from hicache.engine.dcp import BACKENDS


class DecodeArgsError(ValueError):
    """A bad ``hicache decode`` argument; the message is one line naming it."""


@dataclass(frozen=True)
class DecodeSpec:
    dcp: int = 1
    backend: str = "a2a"
    replicate_q: bool = False
    prompt_len: int = 32
    new_tokens: int = 8
    seed: int = 0
    page_size: int = 4
    model_path: Optional[str] = None
    model_overrides: tuple = ()  # ((field, value), ...) applied to the default ModelConfig
    attn_backend: str = "auto"
    warmup_steps: int = 0  # decode steps run (and discarded) on a throwaway request first
    device: str = "cpu"  # "cpu": gloo ranks; "cuda": nccl ranks, one GPU each


def build_model(spec: DecodeSpec):
    from hicache.engine.model import MLAModel, ModelConfig
    if spec.model_path:
        return MLAModel.load(spec.model_path)
    return MLAModel(ModelConfig(seed=spec.seed, **dict(spec.model_overrides)))


def make_prompt(spec: DecodeSpec, vocab_size: int) -> list[int]:
    g = torch.Generator().manual_seed(spec.seed + 1)
    return torch.randint(0, vocab_size, (spec.prompt_len,), generator=g).tolist()


def decode_worker(rank: int, world_size: int, spec: DecodeSpec) -> dict:
    """One rank: build model, pool and runner; prefill and decode; report what this rank saw."""
    from hicache.distributed import CollectiveCounter
    from hicache.engine.runner import DCPRunner, RequestState, reserve
    from hicache.l1 import DeviceKVPool, PageAllocator
    from hicache.layout import DCPLayout

    device = torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" \
        else torch.device("cpu")
    model = build_model(spec).to(device)
    cfg = model.cfg
    layout = DCPLayout(world_size, rank, spec.page_size)
    total = spec.prompt_len + spec.new_tokens
    vps = layout.virtual_page_size
    warm_pages = -(-(spec.warmup_steps + 2) // vps) if spec.warmup_steps else 0
    pages = -(-total // vps) + warm_pages
    pool = DeviceKVPool(layout, cfg.num_layers, cfg.kv_dim, cfg.torch_dtype, pages, device=device)
    alloc = PageAllocator(pages)
    runner = DCPRunner(model, pool, backend=spec.backend, replicate_q=spec.replicate_q,
                       attn_backend=spec.attn_backend)
    prompt = make_prompt(spec, cfg.vocab_size)
    if spec.warmup_steps:
        warm = RequestState()
        runner.generate(warm, prompt[:2], spec.warmup_steps, allocator=alloc)
        alloc.free(warm.page_table)
    runner.stats = type(runner.stats)()
    state = RequestState()
    reserve(state, alloc, total, layout.virtual_page_size)
    t0 = time.perf_counter()
    with CollectiveCounter.measure() as m:
        tokens, times = runner.generate(state, prompt, spec.new_tokens)
    wall = time.perf_counter() - t0
    rows = layout.local_length(state.length)
    elem = torch.empty((), dtype=cfg.torch_dtype).element_size()
    return {
        "tokens": tokens,
        "prompt": prompt,
        "kv_rows": rows,
        "kv_bytes": rows * cfg.kv_dim * elem * cfg.num_layers,
        "collectives_per_layer": runner.stats.dcp_collectives_per_layer(),
        "tp_collectives_per_layer": runner.stats.tp_collectives / max(1, runner.stats.layers_run),
        "collectives_total": m["n"],
        "step_times": times,
        "wall_s": wall,
    }


def decode_worker_many(rank: int, world_size: int, specs: list) -> list[dict]:
    """``decode_worker`` for several specs in one process group (one launch, many configs)."""
    return [decode_worker(rank, world_size, spec) for spec in specs]


def run_spec(spec: DecodeSpec, timeout_s: float = 300.0) -> list[dict]:
    """Run ``decode_worker`` on ``spec.dcp`` gloo processes (in-process when dcp == 1)."""
    if spec.dcp == 1:
        return [decode_worker(0, 1, spec)]
    from hicache.distributed import launch
    backend = "nccl" if spec.device == "cuda" else "gloo"
    return launch(spec.dcp, decode_worker, spec, backend=backend, timeout_s=timeout_s)


# ---- command line ----------------------------------------------------------------------------
def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("decode", help="DCP decode of a seeded prompt over gloo processes",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--dcp", type=int, default=1, help="DCP group size (processes)")
    p.add_argument("--tp", type=int, default=None, help="TP size the group sits in (default dcp)")
    p.add_argument("--backend", default="a2a", help="merge backend: a2a | ag_rs")
    p.add_argument("--replicate-q", action="store_true",
                   help="replicate the query projection (no query all-gather)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=4, help="physical page size P")
    p.add_argument("--model", default=None, help="model file written by MLAModel.save")
    p.add_argument("--device", default="cpu",
                   help="cpu (gloo ranks) or cuda (nccl ranks, one GPU per rank)")
    p.add_argument("--verify", action="store_true",
                   help="compare with the dense single-process reference (exit 1 on mismatch)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")
    p.set_defaults(func=run)
    return p


def spec_from_args(args) -> DecodeSpec:
    """Validate the arguments; every problem is a one-line DecodeArgsError."""
    from hicache.topology import TopologyError, validate
    if args.backend not in BACKENDS:
        raise DecodeArgsError(
            f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    for name in ("dcp", "prompt_len", "page_size"):
        if getattr(args, name) < 1:
            raise DecodeArgsError(
                f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.new_tokens < 0:
        raise DecodeArgsError(f"--new-tokens must be >= 0, got {args.new_tokens}")
    if args.device not in ("cpu", "cuda"):
        raise DecodeArgsError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus < args.dcp:
            raise DecodeArgsError(f"--device cuda needs one GPU per rank: --dcp {args.dcp} but "
                                  f"{gpus} GPU(s) visible")
    tp = args.tp if args.tp is not None else args.dcp
    try:
        validate(tp, args.dcp, 1)
    except TopologyError as exc:
        raise DecodeArgsError(f"--dcp {args.dcp} with --tp {tp}: {exc}") from None
    spec = DecodeSpec(dcp=args.dcp, backend=args.backend, replicate_q=args.replicate_q,
                      prompt_len=args.prompt_len, new_tokens=args.new_tokens, seed=args.seed,
                      page_size=args.page_size, model_path=args.model, device=args.device)
    try:
        model = build_model(spec)
    except ValueError as exc:  # ModelLoadError / ModelConfigError
        raise DecodeArgsError(f"--model: {exc}") from None
    if model.cfg.num_heads % args.dcp:
        raise DecodeArgsError(
            f"--dcp {args.dcp} does not divide the model's {model.cfg.num_heads} attention heads")
    return spec


def summarize(spec: DecodeSpec, results: list[dict]) -> dict:
    tokens = results[0]["tokens"]
    for r, res in enumerate(results):
        if res["tokens"] != tokens:
            raise RuntimeError(f"rank {r} decoded {res['tokens']} but rank 0 decoded {tokens}")
    steps = results[0]["step_times"]
    return {
        "tokens": tokens,
        "kv_rows_per_rank": [r["kv_rows"] for r in results],
        "kv_bytes_per_rank": [r["kv_bytes"] for r in results],
        "collectives_per_layer": results[0]["collectives_per_layer"],
        "step_time_s": statistics.mean(steps) if steps else None,
        "tp_collectives_per_layer": results[0]["tp_collectives_per_layer"],
        "spec": {k: v for k, v in asdict(spec).items() if k != "model_overrides"},
    }


def run(args) -> int:
    spec = spec_from_args(args)
    results = run_spec(spec, timeout_s=args.timeout)
    out = summarize(spec, results)
    rc = 0
    if args.verify:
        model = build_model(spec)
        ref = model.generate(results[0]["prompt"], spec.new_tokens)
        out["reference_tokens"] = ref
        out["verified"] = ref == out["tokens"]
        rc = 0 if out["verified"] else 1
    if args.json:
        print(json.dumps(out))
        return rc
    print(f"tokens: {out['tokens']}")
    for r, (rows, nbytes) in enumerate(zip(out["kv_rows_per_rank"], out["kv_bytes_per_rank"])):
        print(f"rank {r}: kv rows {rows}, kv bytes {nbytes}")
    print(f"collectives per layer: {out['collectives_per_layer']:g} (backend {spec.backend}, "
          f"replicate_q {spec.replicate_q}; plus {out['tp_collectives_per_layer']:g} TP o_proj "
          "all-reduce)")
    st = out["step_time_s"]
    print(f"step time: {st * 1e3:.3f} ms" if st is not None else "step time: n/a (no new tokens)")
    if args.verify:
        print("verify: " + ("OK, matches the dense reference" if out["verified"]
                            else f"MISMATCH, reference {out['reference_tokens']}"))
    return rc


def main(argv=None) -> int:
    """Standalone entry (``python -m hicache.engine.cli decode ...``)."""
    parser = argparse.ArgumentParser(prog="hicache")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DecodeArgsError as exc:
        print(f"hicache decode: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
