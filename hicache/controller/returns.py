"""What the ``learned`` eviction order knows about returns, learnt as it runs. Pure numpy: no
nodes, no I/O, no threads.

A request that caches its pages starts (or extends) a chain; the chain *returns* when a later
request continues it (its prompt holds the whole cached chain: a conversation's next turn).
On production traces most chains never return, and whether one does depends on its request's
class (Mooncake conversation: 25 % after a first turn, 39 % after a second, ... 81 % after an
eighth; a turn that added many new pages 2-4x less often than one that added one or two), while
how long a return takes (the gap) hardly does. The class is the turn, the pages the turn added
and whether it decoded a short answer, under 64 tokens (Mooncake synthetic: 65 % of the
documents whose first request was answered in under 33 tokens are asked again, against 2-16 %
of those answered at length). So the model keeps, per class:

- ``returns``: chains of the class that returned (each class assignment counted once);
- exposure: per insert of the class, the probability that its return, had it come, would have
  been seen by now (``F(age)``; an unbiased denominator for a return rate while the newest
  chains' returns are still to come, as in Kaplan-Meier);

and one distribution of gaps ``F`` over all classes (a histogram over geometric age bins).
From these, each class's return probability ``p`` (shrunk to the overall rate where a class
has seen little) and its *index* at each age ``a``: the most returns per tick of memory a node
still unreturned at age ``a`` can give, over every horizon ``h``,
``max_h p (F(a+h) - F(a)) / integral_a^(a+h) (1 - p F(t)) dt`` (the hit density of LHD,
Beckmann et al., NSDI'18, from these per-class counts). The order evicts the lowest index.

Until ``min_returns`` returns are seen the model is not ``ready`` and the order is LRU.
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np

TURNS = 4                           # turn classes: first, second, third, fourth and later
NEW_PAGE_EDGES = (2, 4, 8, 16, 32, 64)  # new-page classes: [0, 2), [2, 4), ... [64, inf)
DECODED_EDGES = (64,)                # decoded-token classes: [0, 64), [64, inf)
PER_TURN = (len(NEW_PAGE_EDGES) + 1) * (len(DECODED_EDGES) + 1)
CLASSES = TURNS * PER_TURN
MIN_RETURNS = 64     # returns seen before the index replaces LRU
REFRESH = 256        # inserts between two recomputations of the index
PRIOR = 8.0          # a class's rate is shrunk to the overall one as if by this many inserts
MAX_YOUNG = 1 << 16  # insert ticks kept per class; older inserts count as mature (bounded memory)
BINS_PER_OCTAVE = 8
# age bin edges in ticks: 0, 1, 2, ... then geometric (BINS_PER_OCTAVE per doubling), to 2^36
EDGES = np.unique(np.floor(2.0 ** (np.arange(0, 36 * BINS_PER_OCTAVE + 1) / BINS_PER_OCTAVE)))
EDGES = np.concatenate([[0.0], EDGES]).astype(np.int64)
EDGE_LIST = EDGES.tolist()


def request_class(turn: int, new_pages: int, decoded: int = 0) -> int:
    """The class of an insert: its chain's turn (0: a first request, capped at ``TURNS - 1``),
    how many pages it added and how many tokens it decoded."""
    return (min(turn, TURNS - 1) * PER_TURN
            + bisect.bisect_right(NEW_PAGE_EDGES, new_pages) * (len(DECODED_EDGES) + 1)
            + bisect.bisect_right(DECODED_EDGES, decoded))


def class_turn(cls: int) -> int:
    return cls // PER_TURN


def age_bin(age: int) -> int:
    """The bin of ``EDGES`` that holds ``age`` ticks (the last bin past its end)."""
    return min(bisect.bisect_right(EDGE_LIST, age), len(EDGE_LIST) - 1) - 1


def hit_density(p: float, cdf: np.ndarray) -> np.ndarray:
    """Per age bin ``j`` (starting at ``EDGES[j]``): ``max_k p (F_k - F_j) / life(j, k)`` over
    later edges ``k``, where ``life`` integrates the chance of being still unreturned,
    ``1 - p F``, over ``[EDGES[j], EDGES[k])`` (trapezoid per bin). ``cdf``: F at the first
    ``len(cdf)`` edges (bins past them: 0, no return comes that late)."""
    widths = np.diff(EDGES[:len(cdf)]).astype(np.float64)
    alive = 1.0 - p * 0.5 * (cdf[:-1] + cdf[1:])
    life = np.concatenate([[0.0], np.cumsum(widths * alive)])
    gain = p * (cdf[None, :] - cdf[:, None])          # [edges, edges]: from j to k
    span = life[None, :] - life[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(span > 0, gain / span, 0.0)
    out = np.zeros(len(EDGES) - 1)
    out[:len(cdf) - 1] = ratio.max(axis=1)[:-1]
    return out                                          # [bins]


class ReturnModel:
    """Return counts per class, the gap distribution and the index they give."""

    __slots__ = ("returns", "mature", "_young", "gaps", "seen", "_since", "ready",
                 "rates", "_horizon", "min_returns", "refresh_every", "rows")

    def __init__(self, min_returns: int = MIN_RETURNS, refresh_every: int = REFRESH) -> None:
        self.min_returns = min_returns
        self.refresh_every = refresh_every
        self.returns = np.zeros(CLASSES)
        self.mature = np.zeros(CLASSES)       # inserts old enough that F(age) is 1
        self._young: list[deque] = [deque() for _ in range(CLASSES)]  # insert ticks, oldest first
        self.gaps = np.zeros(len(EDGES) - 1)  # returns per gap bin
        self.seen = 0                          # returns in all
        self._since = 0                        # inserts since the index was computed
        # the index: per class, per age bin (lists: one lookup per node an eviction meets)
        self.rows: list[list[float]] = [[0.0] * (len(EDGES) - 1) for _ in range(CLASSES)]
        self.ready = False
        self.rates = np.zeros(CLASSES)
        self._horizon = 0                      # the last gap bin with a return

    def inserted(self, cls: int, now: int) -> None:
        """A chain of class ``cls`` was (re)started at tick ``now``."""
        q = self._young[cls]
        q.append(now)
        if len(q) > MAX_YOUNG:
            q.popleft()
            self.mature[cls] += 1
        self._since += 1
        if self._since >= self.refresh_every:
            self.refresh(now)

    def returned(self, cls: int, gap: int) -> None:
        """A chain of class ``cls`` returned ``gap`` ticks after it was started."""
        self.returns[cls] += 1
        b = age_bin(max(gap, 0))
        self.gaps[b] += 1
        self._horizon = max(self._horizon, b)
        self.seen += 1

    def cdf(self) -> np.ndarray:
        """F (a return's gap at most the edge, among returns) at each of ``EDGES``."""
        c = np.concatenate([[0.0], np.cumsum(self.gaps)])
        return c / c[-1] if c[-1] else c

    def refresh(self, now: int) -> None:
        """Recompute rates and the index from the counts (every ``refresh_every`` inserts)."""
        self._since = 0
        if self.seen < self.min_returns:
            return
        cdf = self.cdf()[:self._horizon + 2]
        done = int(EDGES[self._horizon + 1])  # no return seen later than this
        exposure = np.zeros(CLASSES)
        for c, q in enumerate(self._young):
            while q and now - q[0] >= done:
                q.popleft()
                self.mature[c] += 1
            if q:
                ages = now - np.fromiter(q, np.int64, len(q))
                exposure[c] = cdf[np.searchsorted(EDGES[:len(cdf)], ages, side="right") - 1].sum()
        exposure += self.mature
        overall = self.returns.sum() / max(exposure.sum(), 1.0)
        self.rates = np.minimum((self.returns + PRIOR * overall) / (exposure + PRIOR), 1.0)
        self.rows = [hit_density(float(p), cdf).tolist() for p in self.rates]
        self.ready = True

    def value(self, cls: int, age: int) -> float:
        """The index of a class-``cls`` node unreturned at ``age`` ticks (lower: evict first)."""
        return self.rows[cls][age_bin(age)]
