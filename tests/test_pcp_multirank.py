"""Multi-rank PCP and PD checks over real gloo process groups, ONE launch per group size (2, 4).

PCP prefill (full_kv and ring) matches the dense prefill for lengths divisible and not divisible
by 2N (and shorter than 2N); its KV lands in DCP-striped pools by DCP ownership alone, whatever
the PCP size. PD: a DCP1 prefill relaid into DCP-c decode pools decodes exactly like a DCP-c
prefill; the same-size page path too.
"""

import pytest
import torch
import torch.distributed as dist

from hicache.distributed import CollectiveCounter, all_gather_object, launch
from hicache.engine.model import MLAModel, ModelConfig
from hicache.engine.runner import DCPRunner, RequestState
from hicache.errors import UsageError
from hicache.l1.pool import DeviceKVPool
from hicache.layout import DCPLayout
from hicache.pcp.partition import DualChunkSwap
from hicache.pcp.prefill import (pcp_prefill, pcp_prefill_request, slots_for_pages,
                                 write_pcp_kv_to_pool)
from hicache.pcp.relayout import plan_pd_transfer, run_pd_transfer
from hicache.pcp.ring import ContextParallelAttention, KVPlacement

PAGE = 4  # physical page size P of the decode pools
P = PAGE


def dense_rows(model, tokens):
    """Dense reference: logits [L, V] and the latent rows of every layer [L, kv_dim]."""
    from hicache.engine.attention import attend_latent
    h = model.embed(tokens)
    pos = torch.arange(h.shape[0], dtype=torch.int64)
    rows_all = []
    for layer in model.layers:
        rows = layer.kv_rows(h, pos)
        q_lat, q_pe = layer.query(h, pos)
        o, _ = attend_latent(q_lat, q_pe, rows, pos, pos, model.cfg.softmax_scale,
                             model.cfg.kv_lora_rank)
        h = layer.output(o, h)
        rows_all.append(rows)
    return model.logits(h), rows_all


def check_pool_write(rank, world, res, model, length, dcp, interleave=1):
    """Write this prefill's rows into DCP-``dcp`` pools; check every owned row and no leak."""
    cfg = model.cfg
    page_tokens = PAGE * dcp
    need = -(-length // page_tokens)
    num_pages = need + 2
    pages = torch.arange(num_pages - 1, num_pages - 1 - need, -1)  # scrambled: high ids first
    slots = slots_for_pages(pages, length, page_tokens)
    layout = DCPLayout(dcp, min(rank, dcp - 1), PAGE, interleave)
    pool = DeviceKVPool(layout, cfg.num_layers, cfg.kv_dim, cfg.torch_dtype, num_pages,
                        device="cpu") if rank < dcp else None
    stored = write_pcp_kv_to_pool(res.kv_rows, res.positions, slots, pool, layout=layout)
    # everyone's exact rows by global position (to compare bytes, not values within tolerance)
    parts = all_gather_object((res.positions, [r.float() for r in res.kv_rows]), world)
    full = [torch.zeros(length, cfg.kv_dim) for _ in range(cfg.num_layers)]
    for pos, rows in parts:
        for li in range(cfg.num_layers):
            full[li][pos] = rows[li]
    if pool is None:
        assert stored == 0
        return
    mine = torch.nonzero(layout.owns(slots)).flatten()  # positions this DCP rank owns
    assert stored == mine.numel() == layout.local_length(length) if interleave == 1 else True
    phys = layout.physical(slots[mine])
    for li in range(cfg.num_layers):
        got = pool.kv[li][phys].float()
        assert torch.equal(got, full[li][mine]), (rank, dcp, length, li)
        untouched = torch.ones(pool.num_rows, dtype=torch.bool)
        untouched[phys] = False
        assert not pool.kv[li][untouched].any(), "a row outside the prompt was written"


def prefill_worker(rank, world, lengths):
    torch.manual_seed(0)
    fp32 = MLAModel(ModelConfig(num_layers=2, seed=3))
    bf16 = MLAModel(ModelConfig(num_layers=2, seed=3, dtype="bfloat16"))
    report = []
    for length in lengths:
        tokens = torch.randint(0, fp32.cfg.vocab_size, (length,),
                               generator=torch.Generator().manual_seed(length))
        ref_logits, ref_rows = dense_rows(fp32, tokens)
        part = DualChunkSwap(length, world)
        outs = {}
        for mode in ("full_kv", "ring"):
            with CollectiveCounter.measure() as m:
                res = pcp_prefill(fp32, tokens, mode=mode)
            outs[mode] = res
            assert torch.equal(res.positions, part.positions(rank))
            assert res.logits.shape == (part.num_positions(rank), fp32.cfg.vocab_size)
            err = (res.logits - ref_logits[res.positions]).abs().max().item() \
                if res.positions.numel() else 0.0
            assert err < 1e-4, (mode, length, err)
            assert torch.allclose(res.last_logits, ref_logits[-1], atol=1e-4, rtol=1e-4)
            for li, rows in enumerate(res.kv_rows):
                assert torch.allclose(rows, ref_rows[li][res.positions], atol=1e-4, rtol=1e-4)
            # causal skipping: at least the causal work, less than all pairs (when N > 1)
            layers = fp32.cfg.num_layers
            n_r = part.num_positions(rank)
            assert res.pairs_computed >= layers * part.causal_work(rank)
            if world > 1 and n_r and length >= 4 * world:
                assert res.pairs_computed < layers * n_r * length
            if length % (2 * world) == 0:  # chunk-wise scoring: identical work on every rank
                cs = part.chunk_size
                assert res.pairs_computed == layers * (2 * world + 1) * cs * cs
            report.append((mode, length, err, m["n"]))
        # the two modes agree with each other too
        assert torch.allclose(outs["ring"].logits, outs["full_kv"].logits, atol=1e-5, rtol=1e-5)
        same_last = all_gather_object(outs["ring"].last_logits, world)
        assert all(torch.equal(same_last[0], x) for x in same_last)
        # PCP and DCP are orthogonal: any DCP size <= N, KV striped by DCP ownership alone
        for dcp in sorted({1, 2, world}):
            check_pool_write(rank, world, outs["ring"], fp32, length, dcp)
        check_pool_write(rank, world, outs["full_kv"], fp32, length, world, interleave=2)
        # bf16 rows travel as bytes, exactly
        res16 = pcp_prefill(bf16, tokens, mode="ring")
        assert res16.kv_rows[0].dtype == torch.bfloat16
        check_pool_write(rank, world, res16, bf16, length, world)
    # errors
    with pytest.raises(UsageError, match="mode"):
        pcp_prefill(fp32, [1, 2, 3], mode="nope")
    with pytest.raises(UsageError, match="empty"):
        pcp_prefill(fp32, [], mode="ring")
    with pytest.raises(UsageError, match="rows"):
        pl = KVPlacement.from_partition(DualChunkSwap(8, world))
        ContextParallelAttention(pl, rank, pl.positions[rank], "ring")(
            torch.zeros(pl.lengths[rank], 2, 32), torch.zeros(pl.lengths[rank], 2, 8),
            torch.zeros(99, 40), 1.0, 32)
    gathered = KVPlacement.gather(DualChunkSwap(13, world).positions(rank))
    assert gathered.lengths == KVPlacement.from_partition(DualChunkSwap(13, world)).lengths
    dist.barrier()
    return report


P_SRC = 8  # the prefill instance's page size
SENTINEL = -7.0
NEW = 4


def greedy(runner, state, logits, steps):
    out = []
    for _ in range(steps):
        nxt = int(logits.argmax())
        out.append(nxt)
        logits = runner.extend(state, [nxt])[-1]
    return out


def prompt_rows(pool, pages, length):
    """This rank's rows of the first ``length`` positions, by position: [L, n, D] + positions."""
    layout = pool.layout
    page_tokens = layout.page_tokens
    pos = torch.arange(length)
    slots = torch.as_tensor(pages)[pos // page_tokens] * page_tokens + pos % page_tokens
    mine = layout.owns(slots)
    return pool.kv[:, layout.physical(slots[mine])], pos[mine], layout.physical(slots[mine])


def relayout_worker(rank, c, lengths):
    model = MLAModel(ModelConfig(num_layers=2, seed=5))
    cfg = model.cfg
    out = []
    half = dist.new_group(list(range(c // 2)))  # every rank must call new_group
    for length in lengths:
        prompt = torch.randint(0, cfg.vocab_size, (length,),
                               generator=torch.Generator().manual_seed(100 + length)).tolist()
        page_tokens = P * c
        need = -(-(length + NEW) // page_tokens)
        # reference: DCP-c prefill through the engine
        ref_pool = DeviceKVPool(DCPLayout(c, rank, P), cfg.num_layers, cfg.kv_dim,
                                cfg.torch_dtype, need, device="cpu")
        ref_pages = list(range(need))
        ref_runner = DCPRunner(model, ref_pool)
        ref_state = RequestState(list(ref_pages))
        ref_logits = ref_runner.extend(ref_state, prompt)[-1]
        ref_prompt_rows = prompt_rows(ref_pool, ref_pages, length)[0].clone()
        ref_tokens = greedy(ref_runner, ref_state, ref_logits, NEW)

        # PD: rank 0 runs a DCP1 prefill into a dense pool full of stale garbage
        src_pages = list(range(-(-length // P_SRC) + 1, 0, -1))  # scrambled, page 0 unused
        src_kv, first_logits = None, None
        if rank == 0:
            src_pool = DeviceKVPool(DCPLayout(1, 0, P_SRC), cfg.num_layers, cfg.kv_dim,
                                    cfg.torch_dtype, len(src_pages) + 1, device="cpu")
            src_pool.kv.fill_(1e4)  # stale rows: must never reach a decode pool
            first_logits = DCPRunner(model, src_pool).extend(RequestState(src_pages), prompt)[-1]
            src_kv = src_pool.kv
        first_logits = all_gather_object(first_logits, c)[0]
        assert torch.allclose(first_logits, ref_logits, atol=1e-4, rtol=1e-4)

        dst_pages = list(range(need + 1, 1, -1))[:need]  # other page ids than the reference
        plan = plan_pd_transfer(length, 1, P_SRC, src_pages, c, P, dst_pages)
        assert plan.path == "relayout" and sum(t.num_rows for t in plan.transfers) == length
        pd_pool = DeviceKVPool(DCPLayout(c, rank, P), cfg.num_layers, cfg.kv_dim,
                               cfg.torch_dtype, need + 2, device="cpu")
        pd_pool.kv.fill_(SENTINEL)
        stored = run_pd_transfer(plan, src_kv, pd_pool, [0], list(range(c)))
        assert stored == DCPLayout(c, rank, P).local_length(length)
        rows, _, phys = prompt_rows(pd_pool, dst_pages, length)
        assert torch.equal(rows[0], ref_prompt_rows[0])  # layer 0: bit-identical
        assert torch.allclose(rows, ref_prompt_rows, atol=1e-5, rtol=1e-5)
        others = torch.ones(pd_pool.num_rows, dtype=torch.bool)
        others[phys] = False
        assert bool((pd_pool.kv[:, others] == SENTINEL).all()), "relayout wrote outside the prompt"
        pd_state = RequestState(list(dst_pages), length=length)
        pd_tokens = greedy(DCPRunner(model, pd_pool), pd_state, first_logits, NEW)
        assert pd_tokens == ref_tokens, (length, pd_tokens, ref_tokens)

        # same DCP size: the ordinary page path, rank r -> rank r, bit-identical rows
        ref_pool2 = DeviceKVPool(DCPLayout(c, rank, P), cfg.num_layers, cfg.kv_dim,
                                 cfg.torch_dtype, need, device="cpu")
        ref_state2 = RequestState(list(ref_pages))
        ref_logits2 = DCPRunner(model, ref_pool2).extend(ref_state2, prompt)[-1]
        same_pages = dst_pages
        plan_same = plan_pd_transfer(length, c, P, ref_pages, c, P, same_pages)
        assert plan_same.path == "page"
        assert all(t.src_rank == t.dst_rank for t in plan_same.transfers)
        same_pool = DeviceKVPool(DCPLayout(c, rank, P), cfg.num_layers, cfg.kv_dim,
                                 cfg.torch_dtype, need + 2, device="cpu")
        same_pool.kv.fill_(SENTINEL)
        run_pd_transfer(plan_same, ref_pool2.kv, same_pool, list(range(c)), list(range(c)))
        same_rows, _, phys = prompt_rows(same_pool, same_pages, length)
        assert torch.equal(same_rows, prompt_rows(ref_pool2, ref_pages, length)[0])
        others = torch.ones(same_pool.num_rows, dtype=torch.bool)
        others[phys] = False
        assert bool((same_pool.kv[:, others] == SENTINEL).all())
        same_tokens = greedy(DCPRunner(model, same_pool), RequestState(list(same_pages), length),
                             ref_logits2, NEW)
        assert same_tokens == ref_tokens
        # PCP prefill (ring over the same c ranks) straight into DCP-c pools, then engine decode
        pcp_pool = DeviceKVPool(DCPLayout(c, rank, P), cfg.num_layers, cfg.kv_dim,
                                cfg.torch_dtype, need, device="cpu")
        pcp_state = RequestState(list(ref_pages))
        last = pcp_prefill_request(model, pcp_pool, pcp_state, prompt, mode="ring")
        assert pcp_state.length == length
        assert torch.allclose(last, ref_logits, atol=1e-4, rtol=1e-4)
        pcp_tokens = greedy(DCPRunner(model, pcp_pool), pcp_state, last, NEW)
        assert pcp_tokens == ref_tokens
        # a page the port refuses (here: outside the pool) is refused on every rank before any
        # collective, even one whose rows only some ranks would receive
        bogus = list(ref_pages[:-(-length // pcp_pool.layout.page_tokens)])
        bogus[-1] = 10**6  # the prompt's last page
        with pytest.raises(UsageError, match="outside the pool"):
            pcp_prefill_request(model, pcp_pool, RequestState(bogus), prompt, mode="ring")
        # PCP N = c/2 ranks (a subgroup) into DCP-c pools: ranks outside PCP only receive rows
        sub_pool = DeviceKVPool(DCPLayout(c, rank, P), cfg.num_layers, cfg.kv_dim,
                                cfg.torch_dtype, need, device="cpu")
        sub_state = RequestState(list(ref_pages))
        last = pcp_prefill_request(model, sub_pool, sub_state, prompt, mode="full_kv",
                                   pcp_group=half)
        assert torch.allclose(last, ref_logits, atol=1e-4, rtol=1e-4)
        assert greedy(DCPRunner(model, sub_pool), sub_state, last, NEW) == ref_tokens
        # PCP over all c ranks into DCP-c/2 pools: ranks >= c/2 hold no KV; decode on the half
        small = DCPLayout(c // 2, min(rank, c // 2 - 1), P)
        need_small = -(-(length + NEW) // small.page_tokens)
        small_pool = DeviceKVPool(small, cfg.num_layers, cfg.kv_dim, cfg.torch_dtype,
                                  need_small, device="cpu") if rank < c // 2 else None
        small_state = RequestState(list(range(need_small)))
        last = pcp_prefill_request(model, small_pool, small_state, prompt, mode="ring",
                                   layout=small)
        assert torch.allclose(last, ref_logits, atol=1e-4, rtol=1e-4)
        if small_pool is not None:
            runner = DCPRunner(model, small_pool, group=half if c // 2 > 1 else None)
            assert greedy(runner, small_state, last, NEW) == ref_tokens
        out.append((length, ref_tokens, pd_tokens))
    return out


def worker(rank, world, prefill_lengths, relayout_lengths):
    return prefill_worker(rank, world, prefill_lengths), relayout_worker(rank, world,
                                                                        relayout_lengths)


@pytest.mark.parametrize("world,prefill_lengths,relayout_lengths",
                         [(2, [16, 23, 3], [13, 16]), (4, [32, 37, 3], [13, 35])])
def test_pcp_and_pd_multirank(world, prefill_lengths, relayout_lengths):
    results = launch(world, worker, prefill_lengths, relayout_lengths, timeout_s=300)
    assert len(results) == world
    for rank_report, _ in results:
        for mode, length, err, ncoll in rank_report:
            assert err < 1e-4
            # first the prompt check (one small all-reduce), then the data collectives
            if mode == "full_kv":
                # one all-gather per layer + one all-reduce for the last token's logits
                assert ncoll == 1 + 2 + 1
            else:
                # ring: one exchange per step (N-1 per layer, fewer when blocks are empty)
                assert 2 <= ncoll <= 1 + 2 * (world - 1) + 1
    decoded = [r for _, r in results]
    assert all(r == decoded[0] for r in decoded)  # every rank emitted the same tokens
    assert [x[0] for x in decoded[0]] == relayout_lengths


def test_slots_for_pages_errors():
    assert slots_for_pages([3, 1], 6, 4).tolist() == [12, 13, 14, 15, 4, 5]
    with pytest.raises(UsageError, match="pages"):
        slots_for_pages([0], 9, 4)
