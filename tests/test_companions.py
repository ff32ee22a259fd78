"""One companion mechanism (issue 33 point 1): a third kind of companion, defined here in the
test and nowhere in ``hicache``, goes through L1, L2 and L3 beside the target KV with the
service unchanged: its pages move by jobs of its own transfer engine beside the target's backups
and load-backs, its L3 copy is written once for the group and read back after a warm restart,
its read's page count is agreed by name in the step, its ``finish`` value comes by its own
keyword and goes into the content digest, and ``stats()`` reports it under its name.

The kind, ``Echo``: each position of a cached page keeps the token id it held (one row of one
replicated layer per position), so a page restored from any tier can be compared with the
tokens it names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import l3_writes_land_at_once, make_cfg, write_kv_rows

from hicache import HiCache
from hicache.companions import Companion, Host
from hicache.errors import UsageError
from hicache.l1.pool import DeviceKVPool
from hicache.l2.pool import HostKVPool
from hicache.l2.transfer import TransferEngine
from hicache.layout import DCPLayout
from hicache.page_format import PageFormat


class Echo(Companion):
    """A page's token ids, in every tier (the test's companion kind)."""

    name, finish_arg = "echo", "echo"

    def __init__(self, host: Host) -> None:
        w, cfg = host.page_tokens, host.config
        self.format = PageFormat.replicated(1, w, 1, 1, torch.float32, name="echo")
        self.signature = "echo:1"
        rows = DCPLayout(1, 0, w)
        self.l1 = DeviceKVPool.for_format(rows, self.format, cfg.l1.num_pages)
        self.l2 = HostKVPool.for_format(rows, self.format, max(cfg.l2_num_pages, 1),
                                        layout_kind="page_first", pin="off")
        self.transfer = TransferEngine(self.l1, self.l2)
        self.has = np.zeros(cfg.l1.num_pages, bool)
        self.host_has = np.zeros(max(cfg.l2_num_pages, 1), bool)
        self.moved = {"d2h": 0, "h2d": 0, "l3_read": 0, "l3_write": 0}
        self.store = self.writer = None
        if "l3" in host.tiers:
            from hicache.l3 import Namespace, keys_for_rank, open_store
            from hicache.l3.companion import CompanionWriter
            from hicache.l3.guard import GuardedStore
            ns = Namespace.from_config(cfg, model="echo", fmt=self.format)
            self.keys = lambda chains: keys_for_rank(chains, ns, 0)  # rank 0's: one copy
            self.store = GuardedStore(lambda: open_store(cfg.l3, ns, 0), cfg.l3, 0, ns)
            if host.rank == 0:  # once for the group
                self.writer = CompanionWriter(self.store, lambda n: self._add("l3_write", n))

    def _add(self, what, n):
        self.moved[what] += n

    def forget(self, pages):
        self.has[np.asarray(pages, np.int64)] = False

    def settle(self, host, req):
        req.parts["echo_hit"] = int(self.has[req.prefix.page_table].sum())

    def backup(self, dev, host_pages):
        d, h = np.asarray(dev, np.int64), np.asarray(host_pages, np.int64)
        self.host_has[h] = self.has[d]
        if not self.has[d].any():
            return None
        self._add("d2h", int(self.has[d].sum()))
        return self.transfer.backup(d[self.has[d]], h[self.has[d]])

    def load(self, host_pages, dev):
        d, h = np.asarray(dev, np.int64), np.asarray(host_pages, np.int64)
        self.has[d] = self.host_has[h]
        if not self.host_has[h].any():
            return None
        self._add("h2d", int(self.host_has[h].sum()))
        return self.transfer.load(h[self.host_has[h]], d[self.host_has[h]])

    def write_l3(self, chains, host_pages):
        pairs = [(c, h) for c, h in zip(chains, host_pages) if self.host_has[h]]
        if self.writer is not None and pairs:
            self.writer.submit(self.keys([c for c, _ in pairs]),
                               [self.l2.read_page(h).clone() for _, h in pairs])

    def start_read(self, host, req):
        first = req.prefix.hit_len // host.page_tokens
        keys = self.keys(req.chains(req.tokens[:-1])[first:])
        n = self.store.exists_prefix(keys)
        staging = torch.empty((n, *self.format.shape), dtype=self.format.dtype)
        got = self.store.get(keys[:n], list(staging)) if n else 0
        self._add("l3_read", got)
        req.parts[self.name] = (got, staging)

    def fields(self, req):
        return {"pages": req.parts.get(self.name, (0, None))[0]}

    def decide(self, host, req, agreed, pages):
        req.parts["echo_agreed"] = agreed["pages"]  # found BY NAME, not by position
        return pages

    def restore(self, host, req, dev, pages):
        got, staging = req.parts.pop(self.name, (0, None))
        n = min(pages, got, req.parts.get("echo_agreed", 0))
        if not n:
            return None
        self.has[np.asarray(dev[:n], np.int64)] = True
        return self.transfer.restore(staging[:n], dev[:n])

    def check_finish(self, host, req, arr, end, value):
        if value not in (None, True, False):
            raise UsageError(f"echo must be a bool, got {value!r}")

    def digest(self, value):
        return (int(bool(value)),)

    def finish(self, host, req, arr, end, value):
        if not value:
            return
        w = host.page_tokens
        own = set(req.own_pages)
        for i, p in enumerate(req.prefix.page_table[:end // w]):
            if p in own:
                self.l1.kv.view(-1, w)[p] = torch.as_tensor(arr[i * w:(i + 1) * w],
                                                             dtype=torch.float32)
                self.has[p] = True

    def report(self):
        return {"moved": dict(self.moved), "l1_pages": int(self.has.sum())}

    def close(self):
        self.transfer.close()
        if self.writer is not None:
            self.writer.close()
        if self.store is not None:
            self.store.close()


def _echo_rows(cache, prefix) -> np.ndarray:
    echo = cache.companion("echo")
    w = cache.page_tokens
    n = prefix.hit_len // w
    pages = torch.as_tensor(prefix.page_table[:n], dtype=torch.int64)
    return echo.l1.kv.view(-1, w)[pages].reshape(-1).numpy()


def _serve(cache, rid, prompt, **finish):
    p = cache.admit(rid, prompt)
    while not p.ready:
        cache.step()
    cache.alloc(rid, len(prompt))
    write_kv_rows(cache, rid, len(prompt))
    for layer in range(cache.kv.num_layers):  # every load (and the echo's beside it) landed
        cache.wait_layer(rid, layer)
    hit = _echo_rows(cache, p)
    cache.finish(rid, prompt, **finish)
    return p, hit


def test_a_companion_defined_outside_hicache_goes_through_every_tier(tmp_path):
    cfg = make_cfg(tmp_path / "l3", l1_pages=12, l2_ratio=3.0, prefetch="wait_complete")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128, 33)  # 8 whole pages of 4 (its last token never a hit)
    with l3_writes_land_at_once():
        with HiCache(cfg, mode="l1+l2+l3", companions=[Echo]) as cache:
            _serve(cache, "a", prompt, echo=True)
            p, hit = _serve(cache, "b", prompt, echo=True)  # an L1 hit
            assert p.device_len == 32 and np.array_equal(hit, prompt[:32])
            for i in range(3):  # push it out of L1 (it stays in L2)
                _serve(cache, f"f{i}", rng.integers(0, 128, 33))
            cache.drain()
            p, hit = _serve(cache, "c", prompt, echo=True)  # an L2 hit: loaded beside
            assert p.host_len > 0 and np.array_equal(hit, prompt[:p.hit_len])
            st = cache.stats()["echo"]
            assert st["moved"]["d2h"] > 0 and st["moved"]["h2d"] > 0
            cache.drain()
            assert cache.stats()["echo"]["moved"]["l3_write"] >= 8
        with HiCache(cfg, mode="l1+l2+l3", companions=[Echo]) as cache:  # warm restart
            p, hit = _serve(cache, "d", prompt)
            assert p.storage_len == 32 and np.array_equal(hit, prompt[:32])
            assert cache.stats()["echo"]["moved"]["l3_read"] == 8
            assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}


def test_a_companion_value_is_its_own_keyword_and_checked(tmp_path):
    cfg = make_cfg(tmp_path / "l3")
    with HiCache(cfg, mode="l1+l2", companions=[Echo]) as cache:
        cache.admit("a", np.arange(9))
        cache.alloc("a", 9)
        write_kv_rows(cache, "a", 9)
        with pytest.raises(UsageError, match="echo must be a bool"):
            cache.finish("a", np.arange(9), echo=3)
        with pytest.raises(UsageError, match="draft_len= is no companion's value"):
            cache.finish("a", np.arange(9), draft_len=8)  # no draft here: refused, not lost
        cache.finish("a", np.arange(9), echo=True)
        assert cache.stats()["echo"]["l1_pages"] == 2
    with pytest.raises(UsageError, match="two companions named 'echo'"):
        HiCache(cfg, mode="l1", companions=[Echo, Echo])


def test_a_snapshot_l2_copy_is_a_job_of_the_snapshots_transfer_engine():
    """The KDA snapshots are pools too: the L2 copy of a snapshot is a backup job (timed, per
    layer), and a hit served from L2 gets the bytes the L1 slot held, as a copy."""
    from hicache.companions.snapshot_tier import StateTier
    fmt = PageFormat.state(3, 10, "float32", name="kda_state")
    tier = StateTier(fmt, 2, 2, "cpu", conv_elems=4)
    conv, rec = torch.randn(3, 4), torch.randn(3, 2, 3)
    job = tier.put((conv, rec), 0, 1)
    assert job.direction == "d2h" and job.num_layers == 3 and job.nbytes == fmt.page_bytes
    job.wait()
    tier.put((torch.zeros(3, 4), torch.zeros(3, 6)), 0, None)  # L1 slot 0 reused
    (c, r), where = tier.get(None, 1)
    assert where == "l2" and torch.equal(c, conv) and torch.equal(r, rec.reshape(3, -1))
    (c, _), _ = tier.get(0, None)
    c += 1  # a copy: the slot is untouched
    assert not tier.l1.kv.any()
    assert tier.report()["held_bytes"] == {"l1": fmt.page_bytes, "l2": fmt.page_bytes}
    tier.close()
