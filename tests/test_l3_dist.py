"""Two real gloo ranks share one LMDB env; a page one rank lacks is used by neither."""

import torch

from hicache.distributed import CollectiveCounter, launch
from hicache.l3 import (Namespace, PageStore, PrefetchPolicy, Prefetcher, agree_prefetch,
                        page_keys, restore_length, restore_lengths)

NS = Namespace("m", num_layers=2, kv_dim=8, dtype="bfloat16", page_size=4, dcp_size=2)
PT = NS.page_tokens  # 8 tokens per widened page


def shard(rank, seed):
    g = torch.Generator().manual_seed(1000 * rank + seed)
    return torch.randn(NS.shard_shape, generator=g).to(torch.bfloat16)


def _worker(rank, world, path):
    import torch.distributed as dist

    store = PageStore(path, NS, rank, capacity_bytes=1 << 22, batch_bytes=2 * NS.shard_bytes,
                      sync=False)
    # 1) both ranks write their shards of the same 20 requests concurrently (many txns each)
    for req in range(20):
        toks = list(range(req * 1000, req * 1000 + 3 * PT))
        keys = page_keys(toks, PT, NS, rank)
        assert store.put(keys, [shard(rank, req * 10 + i) for i in range(3)]).written == 3
    dist.barrier()
    assert store.num_pages() == 2 * 20 * 3  # both ranks' shards are in the one env
    for req in range(20):
        keys = page_keys(list(range(req * 1000, req * 1000 + 3 * PT)), PT, NS, rank)
        out = [torch.empty(NS.shard_shape, dtype=torch.bfloat16) for _ in range(3)]
        assert store.get(keys, out) == 3
        assert all(torch.equal(out[i], shard(rank, req * 10 + i)) for i in range(3))
    dist.barrier()

    # 2) a request of 5 pages + a 5-token tail; rank 1 lacks page 2
    toks = list(range(900_000, 900_000 + 5 * PT + 5))
    keys = page_keys(toks, PT, NS, rank)
    stored = [k for i, k in enumerate(keys) if not (rank == 1 and i == 2)]
    store.put(stored, [shard(rank, 500 + i) for i, _ in enumerate(stored)])
    local = store.exists_prefix(keys) * PT
    with CollectiveCounter.measure() as m:
        agreed = restore_length(local, PT)
    one_collective = m["n"]
    with CollectiveCounter.measure() as m:
        many = restore_lengths([local, local + 3, 4], PT)
    with CollectiveCounter.measure() as m2:
        pre_agreed = restore_length(local, PT, agreed=agreed)  # value carried elsewhere
    # 3) prefetch on both ranks, then agree what to use: also one collective for all handles
    pf = Prefetcher(store, PrefetchPolicy("wait_complete"))
    out = [torch.zeros(NS.shard_shape, dtype=torch.bfloat16) for _ in keys]
    h = pf.start("req", keys, out)
    h.wait(30)
    with CollectiveCounter.measure() as m3:
        decision = agree_prefetch([h])
    pf.close()
    store.close()
    return dict(local=local, agreed=agreed, one=one_collective, many=many, many_n=m["n"],
                pre=pre_agreed, pre_n=m2["n"], decision=decision, pf_n=m3["n"],
                pages_done=h.pages_done, ok=bool(torch.equal(out[1], shard(rank, 501))))


def test_two_ranks_share_env_and_agree_on_min(tmp_path):
    res = launch(2, _worker, str(tmp_path), timeout_s=90)
    assert res[0]["local"] == 5 * PT and res[1]["local"] == 2 * PT
    for r in res:
        assert r["agreed"] == 2 * PT  # rank 0 does not use pages 2-4 alone
        assert r["one"] == 1 and r["many_n"] == 1 and r["pre_n"] == 0 and r["pf_n"] == 1
        assert r["many"] == [2 * PT, 2 * PT, 0]
        assert r["pre"] == 2 * PT
        assert r["decision"] == [(True, 2)]
        assert r["ok"]
    assert res[0]["pages_done"] == 5 and res[1]["pages_done"] == 2
