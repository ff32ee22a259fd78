"""Real multi-process (gloo) checks with 2 and 4 ranks, each with its own L1/L2 pools.

One launched group per world size runs every check: several sequence lengths (shorter than c,
multiples of c, partial last pages), both host layouts, backup -> overwrite L1 -> load back.
"""

import torch

from hicache.distributed import CollectiveCounter, all_reduce, launch
from hicache.pages import PageAllocator
from hicache.l1.pool import DeviceKVPool
from hicache.l2.pool import HostKVPool
from hicache.l2.transfer import TransferEngine
from hicache.layout import DCPLayout

P, LAYERS, D = 4, 3, 12


def lengths_for(c):
    return sorted({1, max(c - 1, 1), c, 3 * c, P * c, P * c + 1, 3 * P * c - 1, 37})


def worker(rank, world, kinds, dtype_name):
    dtype = getattr(torch, dtype_name)
    lay = DCPLayout(world, rank, P)
    page_tokens = lay.page_tokens
    out = []
    for kind in kinds:
        dev = DeviceKVPool(lay, LAYERS, D, dtype, 16)
        host = HostKVPool(lay, LAYERS, D, dtype, 12, layout_kind=kind)
        eng = TransferEngine(dev, host)
        dalloc, halloc = PageAllocator(16), PageAllocator(12)
        dalloc.alloc(1)  # offset so that device and host ids differ
        for length in lengths_for(world):
            g = torch.Generator().manual_seed(length)  # same full rows on every rank
            full = torch.randn(LAYERS, length, D, generator=g).to(dtype)
            npages = -(-length // page_tokens)
            dpages, hpages = dalloc.alloc(npages), halloc.alloc(npages)
            pos = torch.arange(length)
            slots = torch.tensor(dpages)[pos // page_tokens] * page_tokens + pos % page_tokens
            for layer in range(LAYERS):
                dev.write(layer, slots, full[layer])
            with CollectiveCounter.measure() as m:
                eng.backup(dpages, hpages).wait()
                dev.kv.fill_(-7)  # overwrite L1
                new = dalloc.alloc(npages)
                job = eng.load(hpages, new)
                nslots = torch.tensor(new)[pos // page_tokens] * page_tokens + pos % page_tokens
                ok = True
                owned_positions = None
                for layer in range(LAYERS):
                    job.wait_layer(layer)
                    owned, rows = dev.read(layer, nslots)
                    mask = lay.owned_mask(nslots)
                    ok &= torch.equal(rows, full[layer][mask])  # bit-identical
                    owned_positions = pos[mask].tolist()
                job.wait()
            out.append(dict(kind=kind, length=length, ok=ok, positions=owned_positions,
                            collectives=m["n"], nbytes=job.nbytes))
            dalloc.free(dpages)
            dalloc.free(new)
            halloc.free(hpages)
        eng.close()
    # the group is alive and agrees on how many checks ran (control plane only, outside transfers)
    t = torch.tensor([len(out)])
    all_reduce(t)
    assert int(t) == world * len(out)
    return out


def check(world, results):
    per_rank = [{(r["kind"], r["length"]): r for r in res} for res in results]
    keys = per_rank[0].keys()
    assert len(keys) == 2 * len(lengths_for(world))
    for key in keys:
        length = key[1]
        union = []
        for rank in range(world):
            r = per_rank[rank][key]
            assert r["ok"], (world, rank, key)
            assert r["collectives"] == 0
            assert len(r["positions"]) == length // world + (rank < length % world)
            assert all(p % world == rank for p in r["positions"])
            union += r["positions"]
        assert sorted(union) == list(range(length))  # the shards tile the sequence exactly


def test_two_ranks_roundtrip():
    results = launch(2, worker, ("layer_first", "page_first"), "bfloat16", timeout_s=120)
    check(2, results)


def test_four_ranks_roundtrip():
    results = launch(4, worker, ("layer_first", "page_first"), "float16", timeout_s=120)
    check(4, results)
