"""Checks a config against this machine before any rank starts: one validation for everyone.

``hicache check-config``, ``hicache-bench`` (in the parent, before spawning), the example loop
and ``HiCache`` itself call :func:`validate`; whatever it rejects, every one of them rejects, with
the same one line naming the key. The memory arithmetic is :func:`memory_need`, a pure function of
the config, the tiers used and the number of ranks sharing the node; :func:`check_node_memory` is
the one comparison of a node's pools with its host memory: the parent's :func:`check_memory`
(before any rank starts: against what is available) and every rank (before allocating: against
the node's total, since its siblings may have allocated already) call it.

What a ``HiCacheConfig`` cannot know by itself lives here: whether CUDA exists (``l2.pin = "on"``),
how much memory the node has (L1 on CPU plus L2 of every rank on the node), whether the L3 path is
usable, and what the built-in engine needs (even ``rope_dim``, heads divisible by ``dcp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import check_int
from .config import HiCacheConfig
from .errors import ConfigError, HostMemoryError
from .companions.snapshot_format import state_bytes

MEMORY_FRACTION = 0.9  # of available memory a node's pools may take



@dataclass(frozen=True)
class Machine:
    """What the node offers; ``detect()`` reads it, tests build one by hand."""

    cuda: bool
    host_available: int              # bytes of host memory available now
    device_free: int | None = None   # bytes free on one GPU (None without CUDA)
    host_total: int | None = None    # bytes of host memory in all (None: unknown)

    @classmethod
    def detect(cls) -> "Machine":
        import psutil
        import torch
        cuda = torch.cuda.is_available()
        free = torch.cuda.mem_get_info()[0] if cuda else None
        vm = psutil.virtual_memory()
        return cls(cuda, int(vm.available), free, int(vm.total))


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes the pools of ``ranks`` ranks on one node take (per rank, then node totals)."""

    ranks: int
    l1_per_rank: int
    l2_per_rank: int          # as allocated (pinned L2 is registered in place: no rounding)
    l1_on_host: bool          # L1 lives in host memory (no CUDA)

    def __post_init__(self) -> None:
        check_int(self.ranks, "ranks on the node", error=ConfigError)
        check_int(self.l1_per_rank, "L1 bytes per rank", 0, error=ConfigError)
        check_int(self.l2_per_rank, "L2 bytes per rank", 0, error=ConfigError)

    @property
    def host_total(self) -> int:
        return self.ranks * (self.l2_per_rank + (self.l1_per_rank if self.l1_on_host else 0))


def memory_need(cfg: HiCacheConfig, ranks: int, *, l2: bool = True,
                cuda: bool = False) -> MemoryNeed:
    """Pure: the bytes L1 and L2 of ``ranks`` ranks of ``cfg`` take on one node (each pool
    holds every format of a page: ``cfg.formats``)."""
    page = cfg.formats.page_bytes
    l1 = cfg.l1.num_pages * page
    l2_bytes = max(cfg.l2_num_pages, 1) * page if l2 else page  # the service keeps >= 1 page
    s1, s2 = state_bytes(cfg, l2)  # a hybrid checkpoint's KDA snapshot pools (else 0, 0)
    l1, l2_bytes = l1 + s1, l2_bytes + s2
    return MemoryNeed(ranks, l1, l2_bytes, l1_on_host=not cuda)


def _size(n: int) -> str:
    if n < 1 << 20:
        return f"{n} bytes"
    return f"{n / (1 << 20):.1f} MiB" if n < 1 << 30 else f"{n / (1 << 30):.2f} GiB"


def check_node_memory(need: MemoryNeed, host_bytes: int, of: str = "are available",
                      fraction: float = MEMORY_FRACTION) -> int:
    """Raise ``HostMemoryError`` when the host pools of ``need.ranks`` ranks exceed ``fraction``
    of ``host_bytes`` (``of`` says which figure that is); else their bytes."""
    if need.host_total > host_bytes * fraction:
        parts = (f"L1 {_size(need.l1_per_rank)} + " if need.l1_on_host else "") \
            + f"L2 {_size(need.l2_per_rank)}"
        raise HostMemoryError(
            f"memory: {need.ranks} rank(s) on this node need {_size(need.host_total)} of host "
            f"memory ({parts} per rank) but {_size(host_bytes)} {of} (limit {fraction:.0%}); "
            "lower l1.num_pages, l2.ratio or l2.size_bytes, or run fewer ranks per node")
    return need.host_total


def check_memory(need: MemoryNeed, machine: Machine, fraction: float = MEMORY_FRACTION) -> None:
    """Raise ``ConfigError`` when the node's pools cannot fit, naming the keys to lower."""
    gib = 1 << 30
    check_node_memory(need, machine.host_available, "are available", fraction)
    if not need.l1_on_host and machine.device_free is not None \
            and need.l1_per_rank > machine.device_free * fraction:
        raise ConfigError(
            f"l1.num_pages: the device pool needs {need.l1_per_rank / gib:.2f} GiB per GPU but "
            f"{machine.device_free / gib:.2f} GiB are free (limit {fraction:.0%})")


def check_l3(cfg: HiCacheConfig) -> list[str]:
    """The selected L3 backend's own preflight (``hicache.l3.registry``) and the fleet secret
    (``hicache.l3.auth``): ConfigError naming the key that cannot run; warnings for what runs
    without L3."""
    from .l3 import auth, registry
    backend = registry.get(cfg.l3.backend)
    warnings = list(backend.preflight(cfg.l3.options, cfg.page_bytes_per_rank))
    auth.required(cfg.l3, backend.shared, backend.name)  # the secret files, or the refusal
    return warnings


def check_engine(cfg: HiCacheConfig) -> None:
    """What the built-in engine (hicache-bench, the examples) needs beyond the cache."""
    m, c = cfg.model, cfg.parallel.dcp
    if m.num_heads % c:
        raise ConfigError(f"model.num_heads: {m.num_heads} is not divisible by parallel.dcp {c} "
                          "(the built-in engine splits attention heads over the DCP ranks)")


def validate(cfg: HiCacheConfig, *, tiers: tuple[str, ...] = ("l1", "l2", "l3"),
             ranks: int | None = None, machine: Machine | None = None,
             engine: bool = True, memory: bool = True) -> list[str]:
    """Check ``cfg`` for a run with ``tiers`` on ``ranks`` ranks of this node (default: the DCP
    group). Raises ``ConfigError`` (one line naming the key) for what cannot run; returns
    warnings (one line each, naming the keys) for what runs but is useless."""
    machine = machine or Machine.detect()
    ranks = cfg.parallel.dcp if ranks is None else ranks
    warnings: list[str] = []
    if cfg.l2.pin == "on" and not machine.cuda:
        raise ConfigError('l2.pin: "on" needs CUDA (pinned host memory cannot be allocated '
                          'without it); use "auto" or "off"')
    if cfg.l2.size_bytes and cfg.l2.size_bytes < cfg.page_bytes_per_rank:
        raise ConfigError(f"l2.size_bytes: {cfg.l2.size_bytes} is smaller than one page "
                          f"({cfg.page_bytes_per_rank} bytes per rank); 0 = use l2.ratio")
    use_l2 = "l2" in tiers
    use_l3 = "l3" in tiers and cfg.l3.enabled
    if use_l3:
        warnings += check_l3(cfg)
        if cfg.l2_num_pages == 0:
            warnings.append("l3.enabled with 0 L2 pages (l2.ratio / l2.size_bytes): pages reach "
                            "L3 through L2, so L3 will store nothing")
    if engine:
        check_engine(cfg)
    if memory:
        check_memory(memory_need(cfg, ranks, l2=use_l2, cuda=machine.cuda), machine)
    return warnings

