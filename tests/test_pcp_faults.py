"""PCP failures are agreed, on ONE real 2-rank gloo group (20 s collective timeout: a rank left
waiting in an all-gather or a ring exchange fails the test instead of stalling it).

In every fault check ONE rank's input is bad or differs (rank 1: another prompt length, other
tokens, a token id outside the vocabulary, a bad or another mode, rows that do not fit their
positions, another rank's pool, other slots, a page table of the same length with other pages,
another interleave, a page its pool refuses). Every rank raises at the same point, before any data collective: the
failing rank its own error, the other ``PeerError`` naming rank 1 and what it raised, or both
``DivergenceError`` when the ranks' inputs merely differ. The group then still carries a further
collective (no rank skipped or added one) and a good prefill still works.
"""

import pytest
import torch

from hicache.distributed import CollectiveCounter, launch
from hicache.errors import HiCacheError

P = 4  # page size of the DCP-2 pools


def _usable(rank) -> bool:
    from hicache.distributed import min_across_ranks
    return min_across_ranks([rank, -rank, 7]) == [0, -1, 7]


def _attempt(fn):
    """(error type name, message, peer rank or None, collectives issued) of ``fn()``."""
    with CollectiveCounter.measure() as n:
        try:
            fn()
            out = ("ok", "", None)
        except HiCacheError as e:
            out = (type(e).__name__, str(e), getattr(e, "rank", None))
    return out + (n["n"],)


def _group(rank, world):
    from hicache.engine.model import MLAModel, ModelConfig
    from hicache.engine.runner import RequestState
    from hicache.l1.pool import DeviceKVPool
    from hicache.layout import DCPLayout
    from hicache.pcp.prefill import (pcp_prefill, pcp_prefill_request, slots_for_pages,
                                     write_pcp_kv_to_pool)
    model = MLAModel(ModelConfig(num_layers=2, seed=3))
    cfg = model.cfg
    prompt = torch.randint(0, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    layout = DCPLayout(2, rank, P)
    pages = list(range(4))
    slots = slots_for_pages(pages, 13, layout.page_tokens)

    def pool(r=rank, num_pages=len(pages), interleave=1):
        return DeviceKVPool(DCPLayout(2, r, P, interleave), cfg.num_layers, cfg.kv_dim,
                            cfg.torch_dtype, num_pages, device="cpu")

    good = pcp_prefill(model, prompt, mode="full_kv")
    mine = rank == 1  # the rank whose input is bad in each check
    other = prompt.clone()
    other[5] = (other[5] + 1) % cfg.vocab_size
    rows = good.kv_rows
    short = tuple(r[:-1] for r in rows)
    outside = prompt.clone()
    outside[6] = cfg.vocab_size  # rank 1 alone: past the vocabulary
    negative = prompt.clone()
    negative[0] = -1  # every rank, on a position only rank 0 computes
    swapped = [1, 0, 2, 3]  # a page table of the same length, other pages
    checks = {
        "prefill_length": lambda: pcp_prefill(model, prompt[:12] if mine else prompt,
                                              mode="full_kv"),
        "prefill_length_ring": lambda: pcp_prefill(model, prompt[:9] if mine else prompt,
                                                   mode="ring"),
        "prefill_tokens": lambda: pcp_prefill(model, other if mine else prompt, mode="ring"),
        "prefill_mode": lambda: pcp_prefill(model, prompt, mode="nope" if mine else "ring"),
        "prefill_modes": lambda: pcp_prefill(model, prompt,
                                             mode="full_kv" if mine else "ring"),
        "prefill_empty": lambda: pcp_prefill(model, prompt[:0] if mine else prompt),
        "prefill_vocab": lambda: pcp_prefill(model, outside if mine else prompt, mode="ring"),
        "prefill_vocab_all": lambda: pcp_prefill(model, negative, mode="ring"),
        "write_rows": lambda: write_pcp_kv_to_pool(short if mine else rows, good.positions,
                                                   slots, pool()),
        "write_pool": lambda: write_pcp_kv_to_pool(rows, good.positions, slots,
                                                   pool(0) if mine else pool()),
        "write_slots": lambda: write_pcp_kv_to_pool(
            rows, good.positions, slots_for_pages(pages, 15 if mine else 13,
                                                  layout.page_tokens), pool()),
        "write_pages": lambda: write_pcp_kv_to_pool(
            rows, good.positions, slots_for_pages(swapped if mine else pages, 13,
                                                  layout.page_tokens), pool()),
        "write_interleave": lambda: write_pcp_kv_to_pool(
            rows, good.positions, slots, pool(interleave=2) if mine else pool()),
        "write_refused": lambda: write_pcp_kv_to_pool(
            rows, good.positions, slots, pool(num_pages=1) if mine else pool()),
        "request_vocab": lambda: pcp_prefill_request(
            model, pool(), RequestState(pages), (outside if mine else prompt).tolist()),
        "request_pages": lambda: pcp_prefill_request(
            model, pool(), RequestState(swapped if mine else pages), prompt.tolist()),
        "request_interleave": lambda: pcp_prefill_request(
            model, pool(interleave=2) if mine else pool(), RequestState(pages),
            prompt.tolist()),
        "request_page": lambda: pcp_prefill_request(
            model, pool(), RequestState([0, 10**6, 2, 3] if mine else pages), prompt.tolist()),
        "request_table": lambda: pcp_prefill_request(
            model, pool(), RequestState(pages[:1] if mine else pages), prompt.tolist()),
    }
    out = {}
    for name, fn in checks.items():
        out[name] = _attempt(fn) + (_usable(rank),)
    # still good: a prefill and a request after all that
    again = pcp_prefill(model, prompt, mode="ring")
    out["again"] = bool(torch.allclose(again.last_logits, good.last_logits, atol=1e-5))
    state = RequestState(list(pages))
    last = pcp_prefill_request(model, pool(), state, prompt.tolist(), mode="ring")
    out["request_ok"] = (state.length, bool(torch.allclose(last, good.last_logits, atol=1e-4)))
    return out


@pytest.fixture(scope="module")
def runs():
    # a 20 s collective timeout: a rank left waiting in a collective fails the test quickly
    return launch(2, _group, timeout_s=20)


DIFFER = {"prefill_length": "prompts have 12 to 13 tokens",
          "prefill_length_ring": "prompts have 9 to 13 tokens",
          "prefill_tokens": "same length (13) but different tokens",
          "prefill_modes": "the ranks use different modes ('full_kv', 'ring'; this rank",
          "write_slots": "the ranks pass 13 to 15 slots",
          "write_pages": "the ranks' page tables differ (same prompt, other slots)",
          "write_interleave": "DCP layouts differ (DCP size 2, 8 tokens a page, interleave 1 "
                              "to 2",
          "request_pages": "the ranks' page tables differ (same prompt, other slots)",
          "request_interleave": "DCP layouts differ (DCP size 2, 8 tokens a page, interleave "
                                "1 to 2"}
# check -> (rank 1's own error, what rank 0's PeerError says rank 1 raised)
BAD = {"prefill_mode": ("UsageError", "mode must be one of"),
       "prefill_empty": ("UsageError", "cannot prefill an empty prompt"),
       "prefill_vocab": ("UsageError", "token ids must be in [0, 256); got range ["),
       "request_vocab": ("UsageError", "token ids must be in [0, 256); got range ["),
       "write_refused": ("UsageError", "page 1 is outside the pool's [0, 1)"),
       "write_rows": ("UsageError", "every layer needs 8 rows"),
       "write_pool": ("UsageError", "pool of DCP rank 0 given on group rank 1"),
       "request_page": ("UsageError", "outside the pool"),
       "request_table": ("UsageError", "13 tokens need 2 pages")}


@pytest.mark.parametrize("name", list(DIFFER))
def test_ranks_whose_inputs_differ_all_raise_before_any_data_moves(runs, name):
    r0, r1 = (r[name] for r in runs)
    for kind, msg, _, ncoll, usable in (r0, r1):
        assert kind == "DivergenceError" and DIFFER[name] in msg, (r0, r1)
        assert ncoll == 1  # the check alone: no data collective was entered
        assert usable


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_on_one_rank_raises_on_every_rank_at_the_same_point(runs, name):
    r0, r1 = (r[name] for r in runs)
    kind, what = BAD[name]
    assert r1[0] == kind and what in r1[1], r1
    assert r0[0] == "PeerError" and r0[2] == 1, r0
    assert f"rank 1 failed ({kind}: " in r0[1] and what in r0[1], r0
    assert r0[3] == r1[3] == 2  # the check, then the gather of the failing rank's message
    assert r0[4] and r1[4]


def test_a_bad_prompt_on_every_rank_raises_on_every_rank_before_any_data_moves(runs):
    # the bad id sits on a position only rank 0 computes: unchecked, rank 0 would raise in its
    # embedding and rank 1 wait in the ring
    for kind, msg, _, ncoll, usable in (r["prefill_vocab_all"] for r in runs):
        assert kind == "UsageError" and "got range [-1, " in msg, msg
        assert ncoll == 2 and usable  # the check, then the gather of the messages


def test_the_group_still_prefills_after_the_faults(runs):
    for r in runs:
        assert r["again"]
        assert r["request_ok"] == (13, True)
