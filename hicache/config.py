"""The offload policy file: TOML (stdlib tomllib) -> frozen dataclasses.

Every section is a frozen dataclass whose fields carry their default, their allowed values or
range, and a one-line help text (used by ``hicache check-config`` and the example file). Every bad
input is a ``ConfigError`` whose message names the full key, e.g. ``policy.write``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from . import topology
from .errors import CheckpointError, ConfigError, L3Error, TopologyError

DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
# the L3 prefetch policies (hicache.l3.prefetch.PrefetchPolicy takes these and the defaults of
# PolicySection's prefetch keys from here)
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def opt(default: Any, help: str, *, choices: tuple = (), min: float | None = None,
        max: float | None = None, type: type | tuple | None = None):
    meta = {"help": help, "choices": choices, "min": min, "max": max, "type": type}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelSection:
    preset: str = opt("", "registry model (deepseek-r1, deepseek-v3, kimi-k2): sets num_layers, "
                          "kv_lora_rank and rope_dim; empty = use the fields below",
                      choices=("", "deepseek-r1", "deepseek-v3", "kimi-k2"))
    num_layers: int = opt(4, "MLA layers whose KV is cached", min=1, max=1024)
    kv_lora_rank: int = opt(64, "latent KV width (512 in DeepSeek-V3)", min=1, max=65536)
    rope_dim: int = opt(16, "decoupled RoPE key width, even (64 in DeepSeek-V3)", min=2,
                        max=65536)
    dtype: str = opt("float32", "KV dtype", choices=tuple(DTYPES))
    hidden_size: int = opt(128, "built-in engine: hidden size", min=1, max=1 << 20)
    num_heads: int = opt(4, "built-in engine: attention heads", min=1, max=4096)
    vocab_size: int = opt(512, "built-in engine: vocabulary size", min=2, max=1 << 24)
    signature: str = opt("", "weights identity (a checkpoint hash or revision), part of the L3 "
                             "namespace; required when L3 is on (HiCache(weights_signature=...) "
                             "overrides it)")
    path: str = opt("", "Hugging Face DeepSeek-V2/V3 checkpoint directory the engine runs: its "
                        "config.json sets num_layers, kv_lora_rank, rope_dim, dtype, hidden_size, "
                        "num_heads and vocab_size; empty = the built-in model")

    def __post_init__(self) -> None:
        if self.preset and self.path:
            raise ConfigError("model.path: conflicts with model.preset; give one or the other")
        for key, value in self.derived().items():
            object.__setattr__(self, key, value)
        if self.rope_dim % 2:
            raise ConfigError(f"model.rope_dim: {self.rope_dim} is odd; RoPE rotates pairs of "
                              "dimensions, so it must be even")

    def derived(self) -> dict:
        """The fields ``preset`` or ``path`` set (empty when neither is given)."""
        if self.preset:
            shape = topology.get_model(self.preset)
            return {"num_layers": shape.num_layers, "kv_lora_rank": shape.kv_lora_rank,
                    "rope_dim": shape.rope_dim}
        if self.path:
            from .checkpoints.hf_config import kv_shape
            try:
                return kv_shape(self.path)
            except CheckpointError as e:
                raise ConfigError(f"model.path: {e}") from None
        return {}

    @property
    def kv_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype]

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class ParallelSection:
    tp: int = opt(1, "tensor-parallel size", min=1, max=4096)
    attn_dp: int = opt(1, "attention data-parallel size", min=1, max=4096)
    dcp: int = opt(1, "decode context-parallel size c (KV striped over c ranks)", min=1, max=4096)
    interleave: int = opt(1, "runs of this many consecutive tokens go to one DCP rank", min=1,
                          max=4096)


@dataclass(frozen=True)
class CacheSection:
    page_size: int = opt(16, "physical page size P (rows per page on each rank); the controller "
                             "sees widened pages of P*dcp tokens", min=1, max=65536)


@dataclass(frozen=True)
class L1Section:
    num_pages: int = opt(256, "widened pages in the device pool (each rank holds P rows of each)",
                         min=1, max=1 << 31)


@dataclass(frozen=True)
class L2Section:
    size_bytes: int = opt(0, "host pool bytes per rank; 0 = use ratio", min=0, max=1 << 50)
    ratio: float = opt(2.0, "host pool size as a multiple of L1 (when size_bytes = 0)", min=0.0,
                       max=1024.0, type=(int, float))
    layout: str = opt("page_first", "host layout: page_first (one copy per page to L3) or "
                                    "layer_first (mirrors L1, cheap per-layer load-back)",
                      choices=("page_first", "layer_first"))
    pin: str = opt("auto", "pin host memory: auto (when CUDA exists), on, off",
                   choices=("auto", "on", "off"))


@dataclass(frozen=True)
class L3Section:
    enabled: bool = opt(False, "persist pages in the L3 page store")
    backend: str = opt("lmdb", "page store: lmdb (embedded, one per node) or redis (a Redis 7+ / "
                               "Valkey 8+ server or cluster shared by the fleet)",
                       choices=("lmdb", "redis"))
    path: str = opt("hicache-l3", "lmdb: environment directory (one per node)")
    size_bytes: int = opt(1 << 30, "lmdb: store capacity in bytes (LRU eviction beyond); redis: "
                                   "the server's maxmemory", min=1 << 20, max=1 << 50)
    url: Any = opt("", "redis: redis://host:port/db, unix:///path.sock, or a list of "
                       "redis://host:port cluster nodes", type=(str, list, tuple))
    timeout_s: float = opt(2.0, "redis: bound on every call (connect, read, write) in seconds",
                           min=0.001, max=600.0, type=(int, float))
    check_on_open: bool = opt(False, "lmdb: walk the whole store in a child process before "
                                     "opening it (a damaged store then disables L3, never the "
                                     "server)")

    def __post_init__(self) -> None:
        if isinstance(self.url, list):
            object.__setattr__(self, "url", tuple(self.url))
        if self.backend != "redis":
            if self.url:
                raise ConfigError(f"l3.url: only used with l3.backend = \"redis\" (backend is "
                                  f"{self.backend!r})")
            return
        if not self.url:
            raise ConfigError("l3.url: l3.backend = \"redis\" needs a url (redis://host:port/db, "
                              "unix:///path.sock, or a list of cluster node URLs)")
        from .l3.redis_store import parse_url
        try:
            parse_url(list(self.url) if isinstance(self.url, tuple) else self.url)
        except L3Error as e:
            raise ConfigError(f"l3.url: {e}") from None


@dataclass(frozen=True)
class PolicySection:
    write: str = opt("write_through", "when to back pages up to L2",
                     choices=("write_through", "write_through_selective", "write_back"))
    selective_threshold: int = opt(2, "write_through_selective: hits before a page is backed up",
                                   min=1, max=1 << 20)
    eviction: str = opt("lru", "eviction order", choices=("lru", "lfu"))
    prefetch: str = opt("timeout", "L3 prefetch policy: wait for the read until it finishes or "
                                   "the timeout passes (timeout), until it finishes "
                                   "(wait_complete), or use what arrived by the next step "
                                   "(best_effort)",
                        choices=PREFETCH_POLICIES)
    prefetch_timeout_s: float = opt(1.0, "timeout policy: base seconds", min=0.0, max=3600.0,
                                    type=(int, float))
    prefetch_timeout_per_1k_s: float = opt(0.05, "timeout policy: extra seconds per 1K tokens",
                                           min=0.0, max=3600.0, type=(int, float))
    prefetch_min_tokens: int = opt(0, "storage hits shorter than this are not prefetched", min=0,
                                   max=1 << 40)
    prefetch_wait_pages: int = opt(8, "an L3 read of at most this many pages is waited for at "
                                      "admission (up to prefetch_wait_s) so the step after "
                                      "admission agrees on it (0: never wait there)",
                                   min=0, max=1 << 20)
    prefetch_wait_s: float = opt(0.01, "the longest admission waits for such a read (on the "
                                       "scheduler thread), in seconds", min=0.0, max=60.0,
                                 type=(int, float))
    load_back_threshold: int = opt(0, "host hits shorter than this many tokens are recomputed",
                                   min=0, max=1 << 40)
    l3_cost_model: bool = opt(True, "decide per L3 hit whether loading beats recomputing, from "
                                    "the measured read and prefill speeds (false: always load)")


@dataclass(frozen=True)
class IOSection:
    backend: str = opt("direct", "copy engine: direct (torch copies) or kernel (Triton, CUDA)",
                       choices=("direct", "kernel"))
    copy_threads: int = opt(2, "CPU copy backend (L1 in host memory): threads that copy one job "
                               "of 8 MiB or more together, taking that many cores while it "
                               "copies (1: the copy thread alone)", min=1, max=16)


SECTIONS: dict[str, type] = {
    "model": ModelSection, "parallel": ParallelSection, "cache": CacheSection, "l1": L1Section,
    "l2": L2Section, "l3": L3Section, "policy": PolicySection, "io": IOSection,
}


@dataclass(frozen=True)
class HiCacheConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    cache: CacheSection = field(default_factory=CacheSection)
    l1: L1Section = field(default_factory=L1Section)
    l2: L2Section = field(default_factory=L2Section)
    l3: L3Section = field(default_factory=L3Section)
    policy: PolicySection = field(default_factory=PolicySection)
    io: IOSection = field(default_factory=IOSection)

    def __post_init__(self) -> None:
        p = self.parallel
        try:
            topology.validate(p.tp, p.dcp, 1, p.attn_dp)  # MLA: one latent KV head
        except TopologyError as e:
            key = "parallel.attn_dp" if "tp % attn_dp" in str(e) else "parallel.dcp"
            raise ConfigError(f"{key}: {e}") from None
        if self.cache.page_size % p.interleave:
            raise ConfigError(f"parallel.interleave: page_size {self.cache.page_size} is not a "
                              f"multiple of interleave {p.interleave}")

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def page_tokens(self) -> int:
        return self.cache.page_size * self.parallel.dcp

    @property
    def l1_tokens(self) -> int:
        """Logical tokens the device pool holds across the DCP group."""
        return self.l1.num_pages * self.page_tokens

    @property
    def l1_tokens_per_rank(self) -> int:
        return self.l1.num_pages * self.cache.page_size

    @property
    def page_bytes_per_rank(self) -> int:
        """One widened page's bytes on one rank across all layers."""
        m = self.model
        return m.num_layers * self.cache.page_size * m.kv_dim * m.dtype_bytes

    @property
    def l2_num_pages(self) -> int:
        if self.l2.size_bytes:
            return self.l2.size_bytes // self.page_bytes_per_rank
        return int(self.l1.num_pages * self.l2.ratio)

    def layout(self, rank: int):
        from .layout import DCPLayout
        return DCPLayout(self.parallel.dcp, rank, self.cache.page_size, self.parallel.interleave)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **sections: Mapping[str, Any]) -> "HiCacheConfig":
        """A copy with some keys changed: ``cfg.replace(l3={"path": "/tmp/x"})`` (validated)."""
        d = self.to_dict()
        for name, values in sections.items():
            d.setdefault(name, {}).update(values)
        return HiCacheConfig.from_dict(d)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HiCacheConfig":
        if not isinstance(d, Mapping):
            raise ConfigError(f"config must be a table, got {type(d).__name__}")
        sections = {}
        for name, value in d.items():
            if name not in SECTIONS:
                raise ConfigError(f"{name}: unknown section{_suggest(name, SECTIONS)}")
            if not isinstance(value, Mapping):
                raise ConfigError(f"{name}: must be a table ([{name}]), got {type(value).__name__}")
            sections[name] = _build_section(name, SECTIONS[name], value)
        return cls(**sections)


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; expected one of {', '.join(options)}"


def _build_section(section: str, kind: type, values: Mapping[str, Any]):
    fields = {f.name: f for f in dataclasses.fields(kind)}
    kwargs = {}
    for key, value in values.items():
        full = f"{section}.{key}"
        if key not in fields:
            raise ConfigError(f"{full}: unknown key{_suggest(key, fields)}")
        f = fields[key]
        meta = f.metadata
        want = meta.get("type") or type(f.default)
        # bool is an int in Python: never accept it where a number is meant, and vice versa
        if isinstance(value, bool) != (want is bool) or not isinstance(value, want):
            names = " or ".join(t.__name__ for t in (want if isinstance(want, tuple) else (want,)))
            raise ConfigError(f"{full}: expected {names}, got {type(value).__name__} {value!r}")
        if meta.get("choices") and value not in meta["choices"]:
            raise ConfigError(f"{full}: {value!r} is not one of "
                              f"{', '.join(repr(c) for c in meta['choices'])}")
        lo, hi = meta.get("min"), meta.get("max")
        if value != value or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ConfigError(f"{full}: {value!r} is out of range [{lo}, {hi}]")
        kwargs[key] = value
    try:
        built = kind(**kwargs)
    except TopologyError as e:
        raise ConfigError(f"{section}.preset: {e}") from None
    if section == "model":  # a value preset / path sets may be repeated, not contradicted
        source = "preset" if values.get("preset") else "path"
        for key, value in built.derived().items():
            if key in values and values[key] != value:
                raise ConfigError(f"model.{key}: {values[key]!r} conflicts with model.{source} "
                                  f"{values[source]!r}, which sets it to {value!r}; give one or "
                                  "the other")
    return built


def loads(text: str, source: str = "<string>") -> HiCacheConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: TOML syntax error: {e}") from None
    return HiCacheConfig.from_dict(data)


MAX_POLICY_BYTES = 1 << 20


def read_regular_file(path: str | Path, what: str, limit: int) -> bytes:
    """At most ``limit`` bytes of a regular file (never a FIFO, a device or a directory, which
    could block or never end); raises ``OSError`` with a one-line reason."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO"
                    if stat.S_ISFIFO(st.st_mode) else "a device or special file")
            raise OSError(0, f"{what} must be a regular file, but this is {kind}")
        if st.st_size > limit:
            raise OSError(0, f"{what} is {st.st_size} bytes; the limit is {limit}")
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            data = f.read(limit + 1)
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > limit:
        raise OSError(0, f"{what} is larger than the limit of {limit} bytes")
    return data


def load_config(path: str | Path) -> HiCacheConfig:
    path = Path(path)
    try:
        text = read_regular_file(path, "the policy file", MAX_POLICY_BYTES).decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the policy file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: the policy file is not UTF-8 text (byte {e.start})") from None
    return loads(text, str(path))


def describe() -> list[tuple[str, Any, str]]:
    """(full key, default, help) for every key: the documentation of the file format."""
    out = []
    for name, kind in SECTIONS.items():
        for f in dataclasses.fields(kind):
            out.append((f"{name}.{f.name}", f.default, f.metadata.get("help", "")))
    return out

