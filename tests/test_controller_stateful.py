"""Hypothesis stateful test of the controller against a model of cached page chains."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.controller import BackupOp, CacheController
from hicache.errors import DeviceFullError, UsageError

PT = 2
PAGES = st.lists(st.integers(0, 3), min_size=1, max_size=6)


def tokens_of(pages, tail):
    t = [p * 10 + i for p in pages for i in range(PT)]
    return np.array(t + [999] * tail, dtype=np.int64)


class ControllerMachine(RuleBasedStateMachine):
    WRITE = "write_through"
    EVICTION = "lru"

    def __init__(self):
        super().__init__()
        self.c = CacheController(PT, 8, 6, write=self.WRITE, eviction=self.EVICTION,
                                 selective_threshold=2)
        self.inserted: set[tuple] = {()}     # model: every page chain ever cached
        self.holds: list = []                # (pages, device_pages_locked, total_locked, handle)
        self.ops: list = []                  # taken, not yet completed

    def longest_model_prefix(self, pages):
        k = 0
        while k < len(pages) and tuple(pages[:k + 1]) in self.inserted:
            k += 1
        return k

    def take(self):
        new = self.c.take_ops()
        self.ops.extend(new)
        return new

    @rule(pages=PAGES, tail=st.integers(0, 1), load=st.booleans())
    def request(self, pages, tail, load):
        c = self.c
        toks = tokens_of(pages, tail)
        m = c.match(toks)
        assert (m.device_len + m.host_len) // PT <= self.longest_model_prefix(pages)
        h = c.lock(m)
        ld = c.load_back(m) if load else None
        have = m.device_len // PT + (len(ld.device_pages) if ld else 0)
        try:
            new = c.alloc_device(len(pages) - have)
        except DeviceFullError:
            c.unlock(h)
            self.take()
            return
        self.take()
        skipped = c.stats.backups_skipped_pages
        dpages = list(m.device_pages) + (list(ld.device_pages) if ld else []) + new
        r = c.insert(toks, dpages)
        c.unlock(h)
        emitted = self.take()
        backups = [o for o in emitted if isinstance(o, BackupOp)]
        assert len(backups) == len(emitted)
        path = []
        n = r.last_node
        while n.parent is not None:
            path.append(n)
            n = n.parent
        by_page = {}
        for node in path:
            for p in node.device:
                by_page[p] = node
        if self.WRITE == "write_back":
            assert not backups, "write_back backs up only on eviction"
        elif self.WRITE == "write_through":
            if c.stats.backups_skipped_pages == skipped:
                assert all(node.host is not None for node in path)
        else:
            for o in backups:
                assert all(by_page[p].hits >= 2 for p in o.device_pages)
            if c.stats.backups_skipped_pages == skipped:
                assert all(node.host is not None for node in path if node.hits >= 2)
        for k in range(1, len(pages) + 1):
            self.inserted.add(tuple(pages[:k]))

    @rule(pages=PAGES)
    def match_only(self, pages):
        m = self.c.match(tokens_of(pages, 0))
        assert (m.device_len + m.host_len) // PT <= self.longest_model_prefix(pages)
        assert not set(m.device_pages) & self.c.request_pages

    @rule(pages=PAGES)
    def hold(self, pages):
        m = self.c.match(tokens_of(pages, 0))
        h = self.c.lock(m)
        self.holds.append((pages, m.device_len, m.device_len + m.host_len, h))

    @precondition(lambda self: self.holds)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        _, _, _, h = self.holds.pop(i % len(self.holds))
        self.c.unlock(h)
        with pytest.raises(UsageError):
            self.c.unlock(h)

    @rule(n=st.integers(1, 8))
    def evict_device(self, n):
        self.c.evict_device(n)
        self.take()

    @rule(n=st.integers(1, 6))
    def evict_host(self, n):
        self.c.evict_host(n)

    @precondition(lambda self: self.ops)
    @rule(data=st.data())
    def complete(self, data):
        ids = [o.op_id for o in self.ops]
        chosen = data.draw(st.lists(st.sampled_from(ids), unique=True))
        self.c.complete(chosen)
        self.ops = [o for o in self.ops if o.op_id not in chosen]

    @invariant()
    def consistent(self):
        c = self.c
        c.check()  # no page leaked or owned twice, tiers/indexes agree
        assert not c.request_pages
        assert sorted(o.op_id for o in self.ops) == c.inflight_ops()
        for pages, dev, total, _ in self.holds:
            m = c.match(tokens_of(pages, 0))
            assert m.device_len >= dev and m.device_len + m.host_len >= total, \
                "a locked path lost pages"


SETTINGS = settings(max_examples=40, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _machine(write, eviction):
    cls = type(f"M_{write}_{eviction}", (ControllerMachine,), {"WRITE": write,
                                                                "EVICTION": eviction})
    cls.TestCase.settings = SETTINGS
    return cls.TestCase


TestWriteThroughLRU = _machine("write_through", "lru")
TestSelectiveLFU = _machine("write_through_selective", "lfu")
TestWriteBackLRU = _machine("write_back", "lru")
TestWriteBackLFU = _machine("write_back", "lfu")


class _LearnedMachine(ControllerMachine):
    """The learned order with its model ready from the first return and refreshed at every
    insert, so that its index (not its LRU warm-up) orders the evictions."""

    def __init__(self):
        super().__init__()
        model = self.c._learner.model
        model.min_returns, model.refresh_every = 1, 1


def _learned_machine(write):
    cls = type(f"M_{write}_learned", (_LearnedMachine,), {"WRITE": write,
                                                          "EVICTION": "learned"})
    cls.TestCase.settings = SETTINGS
    return cls.TestCase


TestWriteThroughLearned = _learned_machine("write_through")
TestWriteBackLearned = _learned_machine("write_back")
