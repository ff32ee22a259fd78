"""Load-or-recompute: is reading a prefix from L3 faster than prefilling it again?

Both rates are measured (a running average of observations): store read bandwidth in bytes/s
per rank (all ranks read their shards in parallel, so pass this rank's bytes) and prefill speed in
tokens/s. A disk-backed hit can lose to recompute; this keeps such hits from being used.
Ranks may measure different rates: feed the decision into the MIN agreement (a rank that would
not load reports 0) so every rank decides alike.
"""

from __future__ import annotations

from .keys import L3Error
from .base import L3Stats


class CostModel:
    def __init__(self, read_bytes_per_s: float, prefill_tokens_per_s: float,
                 overhead_s: float = 0.0, margin: float = 1.0, alpha: float = 0.2) -> None:
        for name, v in (("read_bytes_per_s", read_bytes_per_s),
                        ("prefill_tokens_per_s", prefill_tokens_per_s), ("margin", margin)):
            if not v > 0:
                raise L3Error(f"{name} must be > 0, got {v!r}")
        if overhead_s < 0 or not 0 < alpha <= 1:
            raise L3Error(f"overhead_s must be >= 0 and alpha in (0, 1], got {overhead_s}, {alpha}")
        self.read_bytes_per_s = float(read_bytes_per_s)
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.overhead_s = float(overhead_s)
        self.margin = float(margin)
        self.alpha = float(alpha)

    @classmethod
    def from_stats(cls, stats: L3Stats, prefill_tokens_per_s: float, **kw) -> "CostModel":
        """Read bandwidth from a store's counters (bytes served / time inside get)."""
        if stats.bytes_read <= 0 or stats.read_s <= 0:
            raise L3Error("the store has served nothing yet: no read bandwidth to use")
        return cls(stats.bytes_read / stats.read_s, prefill_tokens_per_s, **kw)

    def observe_read(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.read_bytes_per_s += self.alpha * (nbytes / seconds - self.read_bytes_per_s)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s += self.alpha * (tokens / seconds -
                                                       self.prefill_tokens_per_s)

    def load_seconds(self, nbytes: int) -> float:
        return self.overhead_s + nbytes / self.read_bytes_per_s

    def recompute_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def should_load(self, tokens: int, nbytes: int) -> bool:
        """True when loading ``nbytes`` (this rank) beats prefilling ``tokens``."""
        if tokens < 0 or nbytes < 0:
            raise L3Error(f"tokens and bytes must be >= 0, got {tokens}, {nbytes}")
        if tokens == 0:
            return False
        return self.load_seconds(nbytes) * self.margin < self.recompute_seconds(tokens)
