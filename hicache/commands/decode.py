"""``hicache decode``: spawn a DCP group of gloo processes, prefill a seeded prompt, decode.

    hicache decode --dcp C --backend a2a|ag_rs [--replicate-q] --prompt-len L --new-tokens K
                   --seed S [--page-size P] [--pcp N] [--pcp-mode ring|full_kv] [--model PATH]
                   [--prompt-ids 1,2,3] [--device cpu|cuda] [--verify] [--json]
                   [--spec none|mtp|draft] [--draft-model DIR] [--num-draft-tokens K]

``--model`` is a Hugging Face DeepSeek-V2/V3-family checkpoint directory
(``hicache.checkpoints.hf``) or a file written by ``MLAModel.save``; without it the built-in seeded
tiny model runs. ``--prompt-ids`` gives the prompt's token ids instead of the seeded random
prompt of ``--prompt-len`` tokens, so the greedy tokens can be checked against another
implementation.

``--pcp N`` (default 1: the ordinary DCP prefill through the engine) prefills the prompt with
prefill context parallelism over N ranks (DualChunkSwap chunks, ``ring`` or ``full_kv``
attention; see ``hicache.pcp.prefill``), writes its KV into the DCP-striped pools, then decodes
with DCP C as usual. max(N, C) processes are launched: ranks >= C only help the prefill, ranks
>= N only receive their KV rows.

Prints the token ids, per-rank KV rows and bytes, DCP collectives per layer, the prefill time and
the mean decode step time; ``--json`` prints one object with ``tokens``, ``kv_rows_per_rank``,
``kv_bytes_per_rank``, ``collectives_per_layer``, ``step_time_s``, ``pcp``, ``prefill_time_s``,
``prompt`` (and a few extras). ``--verify`` also runs the dense single-process reference and
fails (exit 1) when the tokens differ.

``--spec mtp`` drafts with the checkpoint's DeepSeek-V3 MTP module, ``--spec draft`` with
``--draft-model`` (same vocabulary); K (1..8) drafts are verified per target step
(``hicache.engine.spec``: the draft's KV is replicated on every DCP rank, the output is plain
greedy decoding's). ``--json`` then has a ``speculative`` object (``proposed``, ``accepted``,
``acceptance_rate``, ``mean_accepted_len``, ``target_steps``, ``tokens_per_target_step``,
``draft_recomputed_tokens``) and ``tpot_s`` (decode wall time per output token).

``add_parser(subparsers)`` adds the subcommand; ``run(args) -> int`` runs it and raises
``UsageError`` (one clear line, exit 2 in the caller) for bad arguments. ``decode_worker`` is
the per-rank body, reused by bench/decode.py.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from hicache.engine.dcp import DCP_BACKENDS
from hicache.errors import TopologyError, UsageError
from hicache.pcp.ring import PCP_MODES


MAX_RANKS = 256          # processes one decode run may launch
MAX_TOKENS = 1 << 20     # prompt + generated tokens of the one request
MAX_PAGE_SIZE = 65536    # as cache.page_size in the policy file
MAX_TIMEOUT_S = 86400


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
    pcp: int = 1  # prefill context-parallel ranks (1: the engine's own DCP prefill)
    pcp_mode: str = "ring"  # "ring" | "full_kv" (used when pcp > 1)
    prompt_ids: tuple = ()  # explicit prompt token ids (overrides the seeded prompt)
    spec: str = "none"  # speculative decoding: none | mtp | draft (hicache.engine.spec)
    draft_model: Optional[str] = None  # --spec draft: the draft checkpoint or model file
    num_draft_tokens: int = 3  # k draft tokens per target step

    def spec_settings(self):
        from hicache.engine.spec import SpecSettings
        return SpecSettings(self.spec, self.draft_model or "", self.num_draft_tokens)

    @property
    def world_size(self) -> int:
        """Processes to launch: the larger of the PCP and DCP groups."""
        return max(self.pcp, self.dcp)


def build_model(spec: DecodeSpec):
    """The checkpoint directory or model file at ``spec.model_path``, else the built-in model."""
    from hicache.engine.model import MLAModel, ModelConfig
    if spec.model_path:
        from hicache.checkpoints.hf import load_model
        return load_model(spec.model_path)
    return MLAModel(ModelConfig(seed=spec.seed, **dict(spec.model_overrides)))


def make_prompt(spec: DecodeSpec, vocab_size: int) -> list[int]:
    if spec.prompt_ids:
        return list(spec.prompt_ids)
    g = torch.Generator().manual_seed(spec.seed + 1)
    return torch.randint(0, vocab_size, (spec.prompt_len,), generator=g).tolist()


def _sync(world_size: int, device: torch.device) -> None:
    """A barrier over the launched world (so the prefill timer starts together)."""
    if world_size > 1:
        from hicache.distributed import all_reduce
        all_reduce(torch.zeros(1, device=device))


def decode_worker(rank: int, world_size: int, spec: DecodeSpec) -> dict:
    """One rank: build model, pool and runner; prefill and decode; report what this rank saw.

    ``world_size`` must be ``spec.world_size``. Ranks < ``spec.dcp`` hold a KV pool shard (their
    KV port) and decode; with ``spec.pcp > 1`` the first ``spec.pcp`` ranks compute the
    prefill, and a rank outside the DCP group returns after it (``role`` "pcp", no tokens).
    """
    from hicache.engine.runner import RequestState, reserve
    from hicache.layout import DCPLayout
    from hicache.pages import PageAllocator

    if world_size != spec.world_size:
        raise UsageError(f"decode_worker needs max(pcp, dcp) = {spec.world_size} ranks, "
                         f"got {world_size}")
    device = torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" \
        else torch.device("cpu")
    dcp_group, pcp_group = _groups(spec, world_size)
    in_dcp = rank < spec.dcp
    model = build_model(spec).to(device)
    layout = DCPLayout(spec.dcp, rank if in_dcp else 0, spec.page_size)
    prompt = make_prompt(spec, model.cfg.vocab_size)
    page_tokens = layout.page_tokens
    total = len(prompt) + spec.new_tokens
    warm_pages = -(-(spec.warmup_steps + 2) // page_tokens) if spec.warmup_steps else 0
    alloc = PageAllocator(-(-total // page_tokens) + warm_pages)
    runner = _runner(model, layout, alloc.num_pages, spec, dcp_group) if in_dcp else None
    _warm_up(runner, alloc, prompt, spec, page_tokens)
    state = RequestState()
    reserve(state, alloc, total, page_tokens)
    drafter = None
    if in_dcp and spec.spec != "none":  # the draft's KV: replicated, on every DCP rank
        from hicache.checkpoints.drafter import make_drafter
        drafter = make_drafter(spec.spec_settings(), model, spec.model_path, page_tokens,
                               state.page_table, alloc.num_pages, spec.attn_backend)
    _sync(world_size, device)
    run = _prefill_and_decode(runner, model, state, prompt, spec, layout, pcp_group, drafter)
    if not in_dcp:
        return {"role": "pcp", "prompt": prompt, "prefill_time_s": run["prefill_time_s"],
                "collectives_total": run["collectives_total"], "wall_s": run["wall_s"]}
    if drafter is not None:  # replicated: this rank holds every draft row
        dcfg = drafter.runner.model.cfg
        elem = torch.empty((), dtype=dcfg.torch_dtype).element_size()
        run["draft_kv_bytes"] = drafter.state.length * dcfg.kv_dim * elem * dcfg.num_layers
    return {"role": "dcp", "prompt": prompt, **_kv_report(runner, state.length), **run}


def _kv_report(runner, length: int) -> dict:
    """This DCP rank's share of a ``length``-token request and its collectives per layer."""
    rows = runner.layout.local_length(length)
    cfg, stats = runner.model.cfg, runner.stats
    elem = torch.empty((), dtype=cfg.torch_dtype).element_size()
    return {"kv_rows": rows, "kv_bytes": rows * cfg.kv_dim * elem * cfg.num_layers,
            "collectives_per_layer": stats.dcp_collectives_per_layer(),
            "tp_collectives_per_layer": stats.tp_collectives / max(1, stats.layers_run)}


def _groups(spec: DecodeSpec, world_size: int) -> tuple:
    """(DCP group, PCP group): None where the group is the whole launched world."""
    dcp_group = pcp_group = None
    if world_size > 1:
        import torch.distributed as dist
        # every rank calls new_group, in the same order, member or not
        if spec.dcp < world_size:
            dcp_group = dist.new_group(list(range(spec.dcp)))
        if 1 < spec.pcp < world_size:
            pcp_group = dist.new_group(list(range(spec.pcp)))
    return dcp_group, pcp_group


def _runner(model, layout, pages: int, spec: DecodeSpec, dcp_group):
    """A DCP rank's engine over a bare L1 pool of ``pages`` widened pages (its KV port)."""
    from hicache.engine.runner import DCPRunner
    from hicache.l1 import DeviceKVPool
    cfg = model.cfg
    pool = DeviceKVPool(layout, cfg.num_layers, cfg.kv_dim, cfg.torch_dtype, pages,
                        device=model.embed_tokens.device)
    return DCPRunner(model, pool, backend=spec.backend, replicate_q=spec.replicate_q,
                     attn_backend=spec.attn_backend, group=dcp_group)


def _warm_up(runner, alloc, prompt: list[int], spec: DecodeSpec, page_tokens: int) -> None:
    """Decode ``spec.warmup_steps`` steps of a throwaway request (DCP ranks), then forget it:
    every rank allocates and frees the same pages, so later page tables agree."""
    from hicache.engine.runner import RequestState, reserve
    if not spec.warmup_steps:
        return
    warm = RequestState()
    reserve(warm, alloc, 2 + spec.warmup_steps, page_tokens)
    if runner is not None:
        runner.generate(warm, prompt[:2], spec.warmup_steps)
        runner.stats = type(runner.stats)()
    alloc.free(warm.page_table)


def _prefill_and_decode(runner, model, state, prompt: list[int], spec: DecodeSpec, layout,
                        pcp_group, drafter=None) -> dict:
    """Prefill (the engine's own, or PCP over ``spec.pcp`` ranks), then greedy decode on the
    DCP ranks (``runner`` None elsewhere): tokens, step times, prefill and wall time,
    collectives."""
    from hicache.distributed import CollectiveCounter
    tokens: list[int] = []
    times: list[float] = []
    extra = {}
    t0 = time.perf_counter()
    with CollectiveCounter.measure() as m:
        if spec.pcp > 1:
            from hicache.pcp.prefill import pcp_prefill_request
            kv = runner.kv if runner is not None else None
            last = pcp_prefill_request(model, kv, state, prompt, mode=spec.pcp_mode,
                                       layout=layout, pcp_group=pcp_group)  # [V]
        else:
            last = runner.extend(state, prompt)[-1]  # [V]
        prefill_s = time.perf_counter() - t0
        if drafter is not None:  # speculative: k drafts verified per target step
            from hicache.engine.spec import SpecStats, speculative_generate
            stats = SpecStats()
            hidden = runner.last_hidden if spec.pcp == 1 else None  # PCP returns no hidden
            tokens = speculative_generate(runner, state, prompt, last, drafter,
                                          spec.num_draft_tokens, spec.new_tokens, hidden,
                                          stats, times)
            extra["speculative"] = stats.to_dict()
            extra["draft_prefill_time_s"] = stats.draft_prefill_s
        for _ in range(spec.new_tokens if runner is not None and drafter is None else 0):
            tokens.append(int(last.argmax()))
            ts = time.perf_counter()
            last = runner.extend(state, [tokens[-1]])[-1]
            times.append(time.perf_counter() - ts)
    return {"tokens": tokens, "step_times": times, "prefill_time_s": prefill_s,
            "wall_s": time.perf_counter() - t0, "collectives_total": m["n"], **extra}


def decode_worker_many(rank: int, world_size: int, specs: list) -> list[dict]:
    """``decode_worker`` for several specs in one process group (one launch, many configs)."""
    return [decode_worker(rank, world_size, spec) for spec in specs]


def run_spec(spec: DecodeSpec, timeout_s: float = 300.0) -> list[dict]:
    """Run ``decode_worker`` on max(pcp, dcp) gloo processes (in-process when that is 1)."""
    world = spec.world_size
    if world == 1:
        return [decode_worker(0, 1, spec)]
    from hicache.distributed import launch
    backend = "nccl" if spec.device == "cuda" else "gloo"
    return launch(world, decode_worker, spec, backend=backend, timeout_s=timeout_s)


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
    p.add_argument("--pcp", type=int, default=1,
                   help="prefill context-parallel ranks N (1: the ordinary DCP prefill); "
                        "max(N, dcp) processes are launched")
    p.add_argument("--pcp-mode", default="ring",
                   help="PCP attention over other ranks' keys: ring | full_kv")
    p.add_argument("--model", default=None,
                   help="Hugging Face DeepSeek-V2/V3 checkpoint directory, or a model file "
                        "written by MLAModel.save (default: the built-in seeded model)")
    p.add_argument("--prompt-ids", default=None,
                   help="comma-separated prompt token ids (instead of a seeded prompt of "
                        "--prompt-len tokens)")
    p.add_argument("--device", default="cpu",
                   help="cpu (gloo ranks) or cuda (nccl ranks, one GPU per rank)")
    p.add_argument("--verify", action="store_true",
                   help="compare with the dense single-process reference (exit 1 on mismatch)")
    p.add_argument("--spec", default="none",
                   help="speculative decoding: none | mtp (the checkpoint's MTP module) | draft "
                        "(--draft-model); greedy output is unchanged")
    p.add_argument("--draft-model", default=None,
                   help="--spec draft: draft checkpoint directory or MLAModel.save file (same "
                        "vocabulary as the target)")
    p.add_argument("--num-draft-tokens", type=int, default=3,
                   help="draft tokens verified per target step, 1..8")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")
    p.set_defaults(func=run)
    return p


def spec_from_args(args) -> DecodeSpec:
    """Validate the arguments; every problem is a one-line UsageError."""
    from hicache.topology import validate
    _check_ranges(args)
    prompt_ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else ()
    tp = args.tp if args.tp is not None else args.dcp
    try:
        validate(tp, args.dcp, 1)
    except TopologyError as exc:
        raise UsageError(f"--dcp {args.dcp} with --tp {tp}: {exc}") from None
    spec_settings = _spec_settings(args)
    spec = DecodeSpec(dcp=args.dcp, backend=args.backend, replicate_q=args.replicate_q,
                      prompt_len=len(prompt_ids) or args.prompt_len,
                      new_tokens=args.new_tokens, seed=args.seed,
                      page_size=args.page_size, model_path=args.model, device=args.device,
                      pcp=args.pcp, pcp_mode=args.pcp_mode, prompt_ids=prompt_ids,
                      spec=spec_settings.method, draft_model=args.draft_model,
                      num_draft_tokens=spec_settings.num_draft_tokens)
    model = _checked_model(spec, args, prompt_ids)
    if spec_settings.enabled:  # load the draft once here: its errors are one line, exit 2
        from hicache.checkpoints.drafter import make_drafter
        make_drafter(spec_settings, model, spec.model_path, 1, [], 1)
    return spec


def _checked_model(spec: DecodeSpec, args, prompt_ids: tuple[int, ...]):
    """The model ``spec`` names, built once here so that a bad checkpoint, a prompt id out of
    its vocabulary or a head count ``--dcp`` does not divide is a one-line UsageError."""
    try:
        model = build_model(spec)
    except ValueError as exc:  # CheckpointError / ConfigError / CheckpointError
        raise UsageError(f"--model: {exc}") from None
    if getattr(model, "hybrid", None) is not None and args.pcp > 1:
        raise UsageError("--pcp: PCP prefill does not run hybrid (MLA + KDA) models; "
                         "use --pcp 1")
    bad = [t for t in prompt_ids if t >= model.cfg.vocab_size]
    if bad:
        raise UsageError(f"--prompt-ids: {bad[0]} is not a token id of the model "
                         f"(vocab_size {model.cfg.vocab_size})")
    if model.cfg.num_heads % args.dcp:
        raise UsageError(
            f"--dcp {args.dcp} does not divide the model's {model.cfg.num_heads} attention heads")
    return model


def _check_ranges(args) -> None:
    """UsageError unless every plain argument is one of its choices or in its range, and the
    GPUs the ranks need are visible."""
    if args.backend not in DCP_BACKENDS:
        raise UsageError(
            f"--backend must be one of {', '.join(DCP_BACKENDS)}, got {args.backend!r}")
    for name, lo, hi in (("dcp", 1, MAX_RANKS), ("pcp", 1, MAX_RANKS),
                         ("prompt_len", 1, MAX_TOKENS), ("new_tokens", 0, MAX_TOKENS),
                         ("page_size", 1, MAX_PAGE_SIZE)):
        if not lo <= getattr(args, name) <= hi:
            raise UsageError(
                f"--{name.replace('_', '-')} must be in [{lo}, {hi}], got {getattr(args, name)}")
    if args.prompt_len + args.new_tokens > MAX_TOKENS:
        raise UsageError(f"--prompt-len + --new-tokens must be <= {MAX_TOKENS}, got "
                         f"{args.prompt_len + args.new_tokens}")
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT_S):
        raise UsageError(f"--timeout must be a number of seconds in (0, {MAX_TIMEOUT_S}], "
                         f"got {args.timeout}")
    if args.seed < 0 or args.seed >= 1 << 63:
        raise UsageError(f"--seed must be in [0, 2**63 - 1], got {args.seed}")
    if args.pcp_mode not in PCP_MODES:
        raise UsageError(
            f"--pcp-mode must be one of {', '.join(PCP_MODES)}, got {args.pcp_mode!r}")
    if args.device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda, got {args.device!r}")
    world = max(args.pcp, args.dcp)
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus < world:
            raise UsageError(f"--device cuda needs one GPU per rank: --dcp {args.dcp} "
                             f"--pcp {args.pcp} launch {world} but {gpus} GPU(s) visible")


def _spec_settings(args):
    """The speculative-decoding settings (``SpecSettings``) of ``--spec``, ``--draft-model``
    and ``--num-draft-tokens``."""
    from hicache.engine.spec import MAX_DRAFT_TOKENS, METHODS, SpecSettings
    if args.spec not in METHODS:
        raise UsageError(f"--spec must be one of {', '.join(METHODS)}, got {args.spec!r}")
    if not 1 <= args.num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise UsageError(f"--num-draft-tokens must be in [1, {MAX_DRAFT_TOKENS}], got "
                         f"{args.num_draft_tokens}")
    if (args.spec == "draft") != bool(args.draft_model):
        raise UsageError("--draft-model DIR is needed with --spec draft, and only there")
    return SpecSettings(args.spec, args.draft_model or "", args.num_draft_tokens)


def _parse_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated ints, got {text!r}") \
            from None
    if any(t < 0 for t in ids):
        raise UsageError(f"--prompt-ids must be >= 0, got {text!r}")
    return ids


def summarize(spec: DecodeSpec, results: list[dict]) -> dict:
    """One report from every rank's result (the DCP ranks are the first ``spec.dcp``)."""
    prefill_s = max(r["prefill_time_s"] for r in results)  # the slowest rank ends the prefill
    results = results[:spec.dcp]
    tokens = results[0]["tokens"]
    for r, res in enumerate(results):
        if res["tokens"] != tokens:
            raise RuntimeError(f"rank {r} decoded {res['tokens']} but rank 0 decoded {tokens}")
    steps = results[0]["step_times"]
    return {
        "tokens": tokens,
        "prompt": results[0]["prompt"],
        "kv_rows_per_rank": [r["kv_rows"] for r in results],
        "kv_bytes_per_rank": [r["kv_bytes"] for r in results],
        "collectives_per_layer": results[0]["collectives_per_layer"],
        "step_time_s": statistics.mean(steps) if steps else None,
        "pcp": spec.pcp,
        "prefill_time_s": prefill_s,
        "tp_collectives_per_layer": results[0]["tp_collectives_per_layer"],
        "tpot_s": _tpot(steps, results[0].get("speculative")),
        "speculative": results[0].get("speculative"),
        "spec": {k: v for k, v in asdict(spec).items()
                 if k not in ("model_overrides", "prompt_ids")},
    }


def _tpot(steps: list[float], speculative: Optional[dict]) -> Optional[float]:
    """Decode wall time per output token: a plain step emits one; a speculative round emits
    its accepted tokens plus one."""
    if not steps:
        return None
    if speculative is None:
        return statistics.mean(steps)
    return sum(steps) / (speculative["tokens_per_target_step"] * speculative["target_steps"])


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
    mode = f" ({spec.pcp_mode})" if spec.pcp > 1 else ""
    print(f"prefill: pcp {spec.pcp}{mode}, {out['prefill_time_s'] * 1e3:.3f} ms")
    st = out["step_time_s"]
    print(f"step time: {st * 1e3:.3f} ms" if st is not None else "step time: n/a (no new tokens)")
    sp = out["speculative"]
    if sp is not None:
        print(f"speculative ({spec.spec}, k {spec.num_draft_tokens}): accepted {sp['accepted']} "
              f"of {sp['proposed']} ({sp['acceptance_rate']:.3f}), "
              f"{sp['tokens_per_target_step']:.2f} tokens per target step, "
              f"{sp['target_steps']} target steps")
    if args.verify:
        print("verify: " + ("OK, matches the dense reference" if out["verified"]
                            else f"MISMATCH, reference {out['reference_tokens']}"))
    return rc


def main(argv=None) -> int:
    """Standalone entry (``python -m hicache.commands.decode decode ...``)."""
    parser = argparse.ArgumentParser(prog="hicache")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"hicache decode: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
