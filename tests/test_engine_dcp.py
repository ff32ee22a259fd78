"""DCP decode over real gloo process groups: same tokens and logits as the dense reference.

One launch per DCP size runs every (backend, replicate_q, prompt length) case plus the verify and
batching checks inside the group; the parent compares against the single-process model.
"""

import pytest
import torch

from hicache.distributed import launch
from hicache.commands.decode import DecodeSpec, build_model, decode_worker, make_prompt, summarize
from hicache.engine.model import MLAModel, ModelConfig
from hicache.engine.runner import DCPRunner, RequestState, reserve
from hicache.errors import TopologyError, UsageError
from hicache.l1 import DeviceKVPool
from hicache.pages import PageAllocator
from hicache.layout import DCPLayout


CFG = ModelConfig(num_layers=2, seed=11)
PAGE = 2
NEW = 4
COMBOS = [("a2a", True), ("a2a", False), ("ag_rs", True), ("ag_rs", False)]


def prompts_for(c):
    g = torch.Generator().manual_seed(100 + c)
    lengths = sorted({2 * c, max(1, c - 1)})  # a multiple of c, shorter than c
    if c == 2:
        lengths.append(2 * c + 1)  # and one neither
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in lengths]


def np_tree(x):
    """Tensors -> numpy: torch tensors in a result would travel as shared memory that dies with
    the worker process."""
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, (list, tuple)):
        return type(x)(np_tree(v) for v in x)
    if isinstance(x, dict):
        return {k: np_tree(v) for k, v in x.items()}
    return x


def t(x):
    return torch.from_numpy(x)


def group_worker(rank, world, plan, verify_prompt, draft, cli_spec):
    """Run each (c, cases) of ``plan`` in DCP groups of c ranks carved out of the world, and the
    ``hicache decode`` per-rank body on the whole world."""
    import torch.distributed as dist
    out = {"cli": decode_worker(rank, world, cli_spec)}
    for c, cases in plan:
        group = None
        if c < world:  # every rank creates every subgroup, in the same order
            groups = [dist.new_group(list(range(s, s + c))) for s in range(0, world, c)]
            group = groups[rank // c]
        out[c] = worker(rank % c, c, cases, verify_prompt, draft, group)
    return out


def worker(rank, world, cases, verify_prompt, draft, group=None):
    """Run every case on this rank; return per-case tokens, logits, rows and pool contents."""
    model = MLAModel(CFG)
    layout = DCPLayout(world, rank, PAGE)
    page_tokens = layout.page_tokens
    pool = DeviceKVPool(layout, CFG.num_layers, CFG.kv_dim, CFG.torch_dtype, 64)
    alloc = PageAllocator(64)
    out = {"cases": []}
    for backend, rq, prompt in cases:
        runner = DCPRunner(model, pool, backend=backend, replicate_q=rq, group=group,
                           attn_backend="torch")
        st = RequestState()
        reserve(st, alloc, len(prompt) + NEW, page_tokens)
        logits = [runner.extend(st, prompt)[-1]]
        toks = []
        for _ in range(NEW):
            toks.append(int(logits[-1].argmax()))
            logits.append(runner.extend(st, [toks[-1]])[-1])
        slots = st.slots(0, st.length, page_tokens)
        owned, rows = pool.read(0, slots)
        pos_of_slot = {int(s): i for i, s in enumerate(slots)}
        out["cases"].append({
            "tokens": toks,
            "logits": torch.stack(logits),
            "rows": layout.local_length(st.length),
            "owned_positions": [pos_of_slot[int(s)] for s in owned],
            "pool_rows_l0": rows.clone(),
            "dcp_per_layer": runner.stats.dcp_collectives_per_layer(),
            "expected_per_layer": runner.comm.collectives_per_layer(),
        })
        alloc.free(st.page_table)

    # multi-token verify: k tokens at once == k sequential single-token decodes
    runner = DCPRunner(model, pool, backend="a2a", replicate_q=True, group=group,
                       attn_backend="torch")
    a, b = RequestState(), RequestState()
    for s in (a, b):
        reserve(s, alloc, len(verify_prompt) + len(draft), page_tokens)
        runner.extend(s, verify_prompt)
    at_once = runner.extend(a, draft)
    one_by_one = torch.cat([runner.extend(b, [t]) for t in draft])
    out["verify"] = (at_once, one_by_one)
    # continuous batching: two requests in one extend_batch == separately
    c1, c2, d1, d2 = (RequestState() for _ in range(4))
    for s, p in ((c1, verify_prompt), (c2, draft), (d1, verify_prompt), (d2, draft)):
        reserve(s, alloc, len(p) + 1, page_tokens)
    batched = runner.extend_batch([c1, c2], [verify_prompt, draft])
    out["batch"] = (batched, [runner.extend(d1, verify_prompt), runner.extend(d2, draft)])

    # chunked prefill of a suffix over KV already in the pool == one prefill
    whole, chunked = RequestState(), RequestState()
    for s in (whole, chunked):
        reserve(s, alloc, len(verify_prompt) + 1, page_tokens)
    full_logits = runner.extend(whole, verify_prompt)
    runner.extend(chunked, verify_prompt[:2])
    out["chunked"] = (full_logits[2:], runner.extend(chunked, verify_prompt[2:]))
    # KV restored into other pages (as from a cache tier): bit-identical next step
    restored = RequestState(length=whole.length)
    reserve(restored, alloc, whole.length + 1, page_tokens)
    src = layout.page_rows(torch.tensor(whole.page_table))
    dst = layout.page_rows(torch.tensor(restored.page_table))
    pool.kv[:, dst] = pool.kv[:, src]
    out["restored"] = (runner.extend(whole, draft[:1]), runner.extend(restored, draft[:1]))
    return np_tree(out)


def check_group(results, cases, c, verify_prompt, draft):
    model = MLAModel(CFG)
    refs = {}
    for i, (backend, rq, prompt) in enumerate(cases):
        if tuple(prompt) not in refs:
            toks = model.generate(prompt, NEW)
            refs[tuple(prompt)] = (toks, model.forward(prompt + toks)[len(prompt) - 1:])
        ref_tokens, ref_logits = refs[tuple(prompt)]
        seq = prompt + ref_tokens
        total = len(seq)
        for r, res in enumerate(results):
            got = res["cases"][i]
            what = f"c={c} rank={r} {backend} replicate_q={rq} prompt_len={len(prompt)}"
            assert got["tokens"] == ref_tokens, what
            assert torch.allclose(t(got["logits"]), ref_logits, atol=2e-4, rtol=1e-4), what
            assert got["rows"] == total // c + (r < total % c), what
            assert got["owned_positions"] == [p for p in range(total) if p % c == r], what
            ref_rows = ref_kv_rows(model, seq)[got["owned_positions"]]
            assert torch.allclose(t(got["pool_rows_l0"]), ref_rows, atol=1e-5), what
            assert got["dcp_per_layer"] == got["expected_per_layer"], what
            if c > 1 and backend == "a2a" and rq:
                assert got["dcp_per_layer"] == 1, what
    ref_verify = model.forward(verify_prompt + draft)[len(verify_prompt):]
    for res in results:
        at_once, one_by_one = map(t, res["verify"])
        assert torch.allclose(at_once, one_by_one, atol=1e-5)
        assert torch.allclose(at_once, ref_verify, atol=2e-4)
        (b1, b2), (s1, s2) = ([t(x) for x in pair] for pair in res["batch"])
        assert torch.allclose(b1, s1, atol=1e-5) and torch.allclose(b2, s2, atol=1e-5)
        full, chunked = map(t, res["chunked"])
        assert torch.allclose(full, chunked, atol=1e-5)
        fresh, restored = map(t, res["restored"])
        assert torch.equal(fresh, restored)


def ref_kv_rows(model, seq):
    """Layer-0 latent rows of the dense reference for positions 0..len-1."""
    h = model.embed(seq)
    return model.layers[0].kv_rows(h, torch.arange(len(seq)))


def make_cases(c):
    return [(b, rq, p) for p in prompts_for(c) for b, rq in COMBOS]


VERIFY_PROMPT = [17, 4, 99, 23, 5]
DRAFT = [8, 140, 2]


def test_dcp1_plain_path_in_process():
    cases = make_cases(1)
    res = worker(0, 1, cases, VERIFY_PROMPT, DRAFT)
    check_group([res], cases, 1, VERIFY_PROMPT, DRAFT)
    assert all(cse["dcp_per_layer"] == 0 for cse in res["cases"])


def test_dcp_groups_of_4_and_2_match_reference():
    """One 4-process launch: c = 4 on the world group, then c = 2 on subgroups {0,1}, {2,3}."""
    plan = [(4, make_cases(4)), (2, make_cases(2))]
    spec = DecodeSpec(dcp=4, backend="ag_rs", replicate_q=True, prompt_len=6, new_tokens=3, seed=5)
    results = launch(4, group_worker, plan, VERIFY_PROMPT, DRAFT, spec, backend="gloo",
                     timeout_s=240)
    summary = summarize(spec, [r["cli"] for r in results])
    model = build_model(spec)
    assert summary["tokens"] == model.generate(make_prompt(spec, model.cfg.vocab_size), 3)
    assert summary["kv_rows_per_rank"] == [3, 2, 2, 2]  # 9 positions over 4 ranks
    row_bytes = model.cfg.kv_dim * 4 * model.cfg.num_layers
    assert summary["kv_bytes_per_rank"] == [3 * row_bytes] + [2 * row_bytes] * 3
    assert summary["collectives_per_layer"] == 2  # ag_rs: lse all-gather + reduce-scatter
    for c, cases in plan:
        for start in range(0, 4, c):
            check_group([results[r][c] for r in range(start, start + c)], cases, c,
                        VERIFY_PROMPT, DRAFT)


def test_engine_errors():
    model = MLAModel(CFG)
    pool = DeviceKVPool(DCPLayout(1, 0, PAGE), CFG.num_layers, CFG.kv_dim, CFG.torch_dtype, 4)
    runner = DCPRunner(model, pool)
    st = RequestState(page_table=[0])
    with pytest.raises(UsageError, match="reserve pages"):
        runner.extend(st, [1, 2, 3])
    with pytest.raises(UsageError, match="at least one"):
        runner.extend(st, [])
    assert st.length == 0  # a refused extend changes nothing
    with pytest.raises(UsageError, match="layers"):
        DCPRunner(model, DeviceKVPool(DCPLayout(1, 0, PAGE), 1, CFG.kv_dim, CFG.torch_dtype, 4))
    with pytest.raises(UsageError, match="dtype"):
        DCPRunner(model, DeviceKVPool(DCPLayout(1, 0, PAGE), CFG.num_layers, CFG.kv_dim,
                                      torch.bfloat16, 4))
    with pytest.raises(TopologyError, match="backend"):
        DCPRunner(model, pool, backend="ring")
    with pytest.raises(TopologyError, match="not divisible"):
        DCPRunner(model, DeviceKVPool(DCPLayout(3, 0, PAGE), CFG.num_layers, CFG.kv_dim,
                                      CFG.torch_dtype, 4))
