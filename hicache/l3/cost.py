"""Load-or-recompute: is reading a prefix from L3 faster than prefilling it again?

Both rates are measured (a running average of observations): store read bandwidth in bytes/s
per rank (all ranks read their shards in parallel, so pass this rank's bytes) and prefill speed in
tokens/s. A disk-backed hit can lose to recompute; this keeps such hits from being used.
Ranks may measure different rates: feed the decision into the MIN agreement (a rank that would
not load reports 0) so every rank decides alike.
"""

from __future__ import annotations

from .base import L3Stats
from ..errors import L3Error


class CostModel:
    """Rates may start unmeasured (None): the first observation sets them, later ones move a
    running average by ``alpha``. Decide with ``should_load`` once ``measured``."""

    def __init__(self, read_bytes_per_s: float | None, prefill_tokens_per_s: float | None,
                 overhead_s: float = 0.0, margin: float = 1.0, alpha: float = 0.2) -> None:
        for name, v in (("read_bytes_per_s", read_bytes_per_s),
                        ("prefill_tokens_per_s", prefill_tokens_per_s)):
            if v is not None and not v > 0:
                raise L3Error(f"{name} must be > 0, got {v!r}")
        if not margin > 0:
            raise L3Error(f"margin must be > 0, got {margin!r}")
        if overhead_s < 0 or not 0 < alpha <= 1:
            raise L3Error(f"overhead_s must be >= 0 and alpha in (0, 1], got {overhead_s}, {alpha}")
        self.read_bytes_per_s = None if read_bytes_per_s is None else float(read_bytes_per_s)
        self.prefill_tokens_per_s = (None if prefill_tokens_per_s is None
                                     else float(prefill_tokens_per_s))
        self.overhead_s = float(overhead_s)
        self.margin = float(margin)
        self.alpha = float(alpha)

    @classmethod
    def from_stats(cls, stats: L3Stats, prefill_tokens_per_s: float, **kw) -> "CostModel":
        """Read bandwidth from a store's counters (bytes served / time inside get)."""
        if stats.bytes_read <= 0 or stats.read_s <= 0:
            raise L3Error("the store has served nothing yet: no read bandwidth to use")
        return cls(stats.bytes_read / stats.read_s, prefill_tokens_per_s, **kw)

    @property
    def measured(self) -> bool:
        """Both rates are known (else there is nothing to decide on)."""
        return self.read_bytes_per_s is not None and self.prefill_tokens_per_s is not None

    def _average(self, old: float | None, rate: float) -> float:
        return rate if old is None else old + self.alpha * (rate - old)

    def observe_read(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.read_bytes_per_s = self._average(self.read_bytes_per_s, nbytes / seconds)

    def observe_overhead(self, seconds: float) -> None:
        """A load's fixed cost beyond its read (e.g. the scheduler step it waits to be agreed)."""
        if seconds > 0:
            self.overhead_s = self._average(self.overhead_s or None, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = self._average(self.prefill_tokens_per_s,
                                                      tokens / seconds)

    def observe_store(self, stats: L3Stats) -> None:
        """Take the read bandwidth from a store's counters (all it served so far), once it
        served anything."""
        if stats.bytes_read > 0 and stats.read_s > 0:
            self.read_bytes_per_s = stats.bytes_read / stats.read_s

    def load_seconds(self, nbytes: int) -> float:
        return self.overhead_s + nbytes / self.read_bytes_per_s

    def recompute_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def should_load(self, tokens: int, nbytes: int) -> bool:
        """True when loading ``nbytes`` (this rank) beats prefilling ``tokens``."""
        if tokens < 0 or nbytes < 0:
            raise L3Error(f"tokens and bytes must be >= 0, got {tokens}, {nbytes}")
        if not self.measured:
            raise L3Error("the cost model has not measured both rates yet")
        if tokens == 0:
            return False
        return self.load_seconds(nbytes) * self.margin < self.recompute_seconds(tokens)
