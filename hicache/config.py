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
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from . import topology
from .errors import CheckpointError, ConfigError, TopologyError

KV_DTYPES = ("float32", "float16", "bfloat16")  # sizes: hicache.page_format (torch)
# the L3 prefetch policies (hicache.l3.prefetch.PrefetchPolicy takes these and the defaults of
# PolicySection's prefetch keys from here)
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def opt(default: Any, help: str, *, choices: tuple = (), min: float | None = None,
        max: float | None = None, type: type | tuple | None = None):
    meta = {"help": help, "choices": choices, "min": min, "max": max, "type": type}
    return field(default=default, metadata=meta)


# The schema below is the one home of every key's choices, default and range: code elsewhere
# (the pools, the transfer engine, the controller, the CLIs) reads them through these three.
def _key(section: type, key: str) -> dataclasses.Field:
    return {f.name: f for f in dataclasses.fields(section)}[key]


def choices(section: type, key: str) -> tuple:
    """The allowed values of ``section.key`` (e.g. ``choices(L2Section, "layout")``)."""
    return _key(section, key).metadata["choices"]


def default(section: type, key: str) -> Any:
    """The default of ``section.key``."""
    return _key(section, key).default


def bounds(section: type, key: str) -> tuple[Any, Any]:
    """``(min, max)`` of a numeric key."""
    meta = _key(section, key).metadata
    return meta["min"], meta["max"]


@dataclass(frozen=True)
class ModelSection:
    preset: str = opt("", "registry model (deepseek-r1, deepseek-v3, kimi-k2): sets num_layers, "
                          "kv_lora_rank and rope_dim; empty = use the fields below",
                      choices=("",) + tuple(n for n, m in topology.MODELS.items()
                                            if m.attention == "mla"))
    num_layers: int = opt(4, "MLA layers whose KV is cached", min=1, max=1024)
    kv_lora_rank: int = opt(64, "latent KV width (512 in DeepSeek-V3)", min=1, max=65536)
    rope_dim: int = opt(16, "decoupled RoPE key width, even (64 in DeepSeek-V3)", min=2,
                        max=65536)
    dtype: str = opt("float32", "KV dtype", choices=KV_DTYPES)
    hidden_size: int = opt(128, "built-in engine: hidden size", min=1, max=1 << 20)
    num_heads: int = opt(4, "built-in engine: attention heads", min=1, max=4096)
    vocab_size: int = opt(512, "built-in engine: vocabulary size", min=2, max=1 << 24)
    signature: str = opt("", "weights identity (a checkpoint hash or revision), part of the L3 "
                             "namespace; required when L3 is on, unless model.path names a "
                             "checkpoint (then its content signature: config, safetensors "
                             "headers, sampled bytes); HiCache(weights_signature=...) overrides it")
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
    """``[l3]``: the keys every backend shares, and one sub-table ``[l3.<backend>]`` per backend
    (its keys are declared by the backend's module in ``hicache.l3.registry``; this module names
    no backend and imports none: a backend's module is imported when a policy names it)."""

    enabled: bool = opt(False, "persist pages in the L3 page store")
    backend: str = opt("lmdb", "page store backend, a name in the L3 registry: "
                               "lmdb (embedded, one per node) or redis (a Redis 7+ / Valkey 8+ "
                               "server or cluster shared by the fleet); its keys go in "
                               "[l3.<backend>] (the default is hicache.l3.registry.DEFAULT)")
    secret_file: str = opt("", "fleet secret (a file readable by its owner only) that keys L3 "
                               "key derivation and the value MAC; $HICACHE_L3_SECRET_FILE if empty")
    previous_secret_file: str = opt("", "the secret before a rotation: values it signed are "
                                        "still read (writes use secret_file); "
                                        "$HICACHE_L3_PREVIOUS_SECRET_FILE if empty")
    authenticate: bool = opt(True, "a shared backend (redis) refuses to start without a secret; "
                                   "false runs it unauthenticated (anyone who can write to the "
                                   "server can then poison the cache)")
    # the [l3.<backend>] tables given: ((name, section), ...) sorted by name (hashable)
    stores: tuple = field(default=(), repr=False, metadata={"table": True})

    def __post_init__(self) -> None:
        from .l3 import registry
        if registry.DEFAULT != L3Section.backend:
            raise AssertionError("[l3] backend's default must be the registry's DEFAULT")
        if not isinstance(self.backend, str) or not registry.known(self.backend):
            raise ConfigError(f"l3.backend: {self.backend!r} is not one of "
                              f"{', '.join(repr(n) for n in registry.names())}")

    @property
    def options(self):
        """The selected backend's ``[l3.<backend>]`` section (its defaults when not given)."""
        from .l3 import registry
        given = dict(self.stores).get(self.backend)
        return given if given is not None else registry.get(self.backend).section()

    def __getattr__(self, name: str):
        # cfg.l3.path and friends: a key of the selected backend's section
        if name.startswith("_") or name in ("stores", "backend"):
            raise AttributeError(name)
        opts = self.options
        if any(f.name == name for f in dataclasses.fields(opts)):
            return getattr(opts, name)
        raise AttributeError(f"'L3Section' has no attribute {name!r} (nor has [l3.{self.backend}])")


class ConfigDeprecation(FutureWarning):
    """An old policy key that is still read; printed as one line (``warning: ...``)."""


def _one_line(message, category, filename, lineno, line=None, _next=warnings.formatwarning):
    if isinstance(category, type) and issubclass(category, ConfigDeprecation):
        return f"warning: {message}\n"
    return _next(message, category, filename, lineno, line)


warnings.formatwarning = _one_line


def _build_l3(values: Mapping[str, Any], *, legacy_warning: bool = True) -> L3Section:
    """``[l3]`` with its ``[l3.<backend>]`` tables; a flat key of a backend (the old layout) is
    moved into its table with one deprecation line naming the new keys."""
    from .l3 import registry
    own = {f.name for f in dataclasses.fields(L3Section) if not f.metadata.get("table")}
    flat = {k: v for k, v in values.items() if k in own}
    backend = flat.get("backend", L3Section.backend)
    if not isinstance(backend, str) or not registry.known(backend):
        _build_section("l3", L3Section, {"backend": backend})  # the one-line error
    tables: dict = {}
    moved: list[tuple[str, str]] = []
    for key, value in values.items():
        if key in own:
            continue
        if isinstance(value, Mapping):
            if not registry.known(key):
                raise ConfigError(f"l3.{key}: unknown backend table{_suggest(key, registry.names())}")
            tables[key] = dict(value)
            continue
        owner = _legacy_owner(key, backend, registry)
        if owner is None:
            raise ConfigError(f"l3.{key}: unknown key{_suggest(key, [*own, *registry.names()])}")
        if owner == backend:
            tables.setdefault(owner, {})
            if key in tables[owner]:
                raise ConfigError(f"l3.{key}: given twice (also as l3.{owner}.{key})")
        moved.append((key, owner))
        tables.setdefault(owner, {})[key] = value
    if moved and legacy_warning:
        warnings.warn(f"{', '.join(f'l3.{k}' for k, _ in moved)}: flat [l3] backend keys are "
                      f"deprecated; write {', '.join(f'l3.{o}.{k}' for k, o in moved)} "
                      f"(in a [l3.<backend>] table)", ConfigDeprecation, stacklevel=4)
    stores = {}
    for name, table in tables.items():
        stores[name] = _build_section(f"l3.{name}", registry.get(name).section, table)
    enabled = flat.get("enabled", False)
    if backend in stores or enabled or "backend" in flat:
        b = registry.get(backend)
        b.complete(stores.get(backend) or b.section())
    built = _build_section("l3", L3Section, flat)
    return dataclasses.replace(built, stores=tuple(sorted(stores.items()))) if stores else built


def _legacy_owner(key: str, backend: str, registry) -> str | None:
    """The backend whose table an old flat ``[l3]`` key belongs to (the selected one first)."""
    first = (backend,) if registry.known(backend) else ()
    for name in (*first, *[n for n in registry.names() if n != backend]):
        if any(f.name == key for f in dataclasses.fields(registry.get(name).section)):
            return name
    return None


@dataclass(frozen=True)
class PolicySection:
    write: str = opt("write_through", "when to back pages up to L2",
                     choices=("write_through", "write_through_selective", "write_back"))
    selective_threshold: int = opt(2, "write_through_selective: hits before a page is backed up",
                                   min=1, max=1 << 20)
    eviction: str = opt("learned", "eviction order: least likely to be continued soon, by "
                                      "return rates learnt per request class (learned; least "
                                      "recently used until 64 returns are seen), least "
                                      "recently used (lru), least frequently used (lfu), or "
                                      "least likely to be reused soon, by reuse rates learnt "
                                      "per use count (reuse)",
                         choices=("lru", "lfu", "reuse", "learned"))
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


@dataclass(frozen=True)
class SpecSection:
    method: str = opt("none", "speculative decoding: none, mtp (the checkpoint's MTP module) or "
                              "draft (a separate draft model); greedy output is unchanged",
                      choices=("none", "mtp", "draft"))
    draft_model: str = opt("", "method draft: the draft checkpoint directory (same vocabulary "
                               "as the target)")
    num_draft_tokens: int = opt(3, "draft tokens k verified per target step", min=1, max=8)

    def __post_init__(self) -> None:
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("spec.draft_model: method 'draft' needs a draft model directory")
        if self.method != "draft" and self.draft_model:
            raise ConfigError(f"spec.draft_model: given, but spec.method is {self.method!r} "
                              "(only 'draft' uses it)")


@dataclass(frozen=True)
class HybridSection:
    """``[hybrid]``: the KDA state snapshots of a hybrid checkpoint (Kimi Linear; read only when
    ``model.path`` is one, docs/hybrid.md)."""
    snapshot_every_pages: int = opt(0, "hybrid models: also snapshot the KDA state every this "
                                       "many widened pages of an inserted prefix (0: only at "
                                       "the end of each inserted prefix)", min=0, max=1 << 20)
    l1_state_bytes: int = opt(1 << 28, "hybrid models: device bytes per rank for KDA state "
                                       "snapshots (must hold at least one; L2 holds l2.ratio "
                                       "times as many)", min=0, max=1 << 50)


@dataclass(frozen=True)
class TenancySection:
    """``[tenancy]``: cache scopes (docs/trust.md)."""
    default_scope: str = opt("", "the scope of a request admitted without one (empty: the "
                                 "shared scope, every such request shares its prefixes); a "
                                 "request's own scope (HiCache.admit(scope=...)) wins")


@dataclass(frozen=True)
class EventsSection:
    """``[events]``: KV events in vLLM's wire format for routers (docs/integrations.md)."""
    endpoint: str = opt("", "ZMQ endpoint the DCP group's KV events go to: tcp://HOST:PORT "
                            "connects to a subscriber that binds, tcp://*:PORT binds (empty: "
                            "no events); DCP group i uses PORT + i")
    replay_endpoint: str = opt("", "ZMQ endpoint (bound) answering replay requests from a "
                                   "sequence number (empty: none); DCP group i uses PORT + i")
    topic: str = opt("", "topic frame of every batch (llm-d's indexer reads "
                         "kv@<pod>@<model>)")
    queue_batches: int = opt(10_000, "batches waiting to be sent; more are dropped (counted), "
                                     "never waited for", min=1, max=1 << 24)
    replay_batches: int = opt(10_000, "batches kept for replay", min=1, max=1 << 24)

    def __post_init__(self) -> None:
        from .errors import UsageError
        from .events.endpoints import check_endpoint
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self, key)
            if value:
                try:
                    check_endpoint(value, key)
                except UsageError as e:
                    raise ConfigError(f"events.{e}") from None


SECTIONS: dict[str, type] = {
    "model": ModelSection, "parallel": ParallelSection, "cache": CacheSection, "l1": L1Section,
    "l2": L2Section, "l3": L3Section, "policy": PolicySection, "io": IOSection,
    "spec": SpecSection, "hybrid": HybridSection, "tenancy": TenancySection,
    "events": EventsSection,
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
    spec: SpecSection = field(default_factory=SpecSection)
    hybrid: HybridSection = field(default_factory=HybridSection)
    tenancy: TenancySection = field(default_factory=TenancySection)
    events: EventsSection = field(default_factory=EventsSection)

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
        if self.model.path:
            self.state_format  # a hybrid checkpoint's snapshot must fit its pool (ConfigError)

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
    def page_format(self):
        """The target KV's ``PageFormat`` (``hicache.page_format``): every size the pools, the
        transfers, L3 and the memory checks use comes from it."""
        from .page_format import PageFormat
        m = self.model
        return PageFormat.striped_kv(m.num_layers, self.cache.page_size, m.kv_dim, m.dtype)

    @property
    def formats(self):
        """The ``FormatSet`` of one logical page: the target KV, and the draft's replicated KV
        when ``[spec]`` is on (``hicache.companions.draft_format``)."""
        from .page_format import FormatSet
        from .companions.draft_format import draft_format
        draft = draft_format(self)  # spec: the draft KV's companion format
        return FormatSet(self.page_format, (draft,) if draft is not None else ())

    @property
    def state_format(self):
        """The KDA state snapshot's STATE ``PageFormat`` of a hybrid checkpoint (``model.path``
        a Kimi Linear directory), else None; a snapshot pool too small for one is an error."""
        from .companions.snapshot_format import state_format
        return state_format(self)

    @property
    def page_bytes_per_rank(self) -> int:
        """One widened page's bytes on one rank, every format of the page together."""
        return self.formats.page_bytes

    @property
    def l2_num_pages(self) -> int:
        if self.l2.size_bytes:
            return self.l2.size_bytes // self.page_bytes_per_rank
        return int(self.l1.num_pages * self.l2.ratio)

    def layout(self, rank: int):
        from .layout import DCPLayout
        return DCPLayout(self.parallel.dcp, rank, self.cache.page_size, self.parallel.interleave)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["l3"].update(dict(d["l3"].pop("stores")))  # [l3.<backend>] tables
        return d

    def public_dict(self) -> dict:
        """:meth:`to_dict` with secrets taken out (a Redis URL's password): for reports, logs
        and ``--out`` files. Not loadable back where a password was needed."""
        from .l3 import registry
        d = self.to_dict()
        for name in list(d["l3"]):
            if isinstance(d["l3"][name], dict) and registry.known(name):
                d["l3"][name] = registry.get(name).public(d["l3"][name])
        return d

    def value(self, key: str) -> Any:
        """The resolved value of a documented key (``describe()``): ``l2.ratio``,
        ``l3.lmdb.path`` (a backend table not given: its default), with no password."""
        from .l3 import registry
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == "l3":
            b = registry.get(parts[1])
            table = dict(self.l3.stores).get(parts[1]) or b.section()
            return b.public(dataclasses.asdict(table))[parts[2]]
        return getattr(getattr(self, parts[0]), parts[1])

    def replace(self, **sections: Mapping[str, Any]) -> "HiCacheConfig":
        """A copy with some keys changed: ``cfg.replace(l3={"path": "/tmp/x"})`` (validated)."""
        d = self.to_dict()
        for name, values in sections.items():
            if name == "l3":
                values = _route_l3(d.get("l3", {}), values)
            d.setdefault(name, {}).update(values)
        return HiCacheConfig.from_dict(d)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HiCacheConfig":
        if not isinstance(d, Mapping):
            raise ConfigError(f"config must be a table, got {type(d).__name__}")
        sections, errors = {}, []
        for name, value in d.items():
            try:
                if name not in SECTIONS:
                    raise ConfigError(f"{name}: unknown section{_suggest(name, SECTIONS)}")
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{name}: must be a table ([{name}]), got "
                                      f"{type(value).__name__}")
                sections[name] = (_build_l3(value) if name == "l3" else
                                  _build_section(name, SECTIONS[name], value))
            except ConfigError as e:  # every section's errors are reported together
                errors.extend(getattr(e, "errors", None) or [str(e)])
        raise_all(errors)
        return cls(**sections)


def _route_l3(old: Mapping[str, Any], values: Mapping[str, Any]) -> dict:
    """``replace(l3={...})``: a backend key given flat goes into its backend's table (no
    deprecation: this is the API, not the file)."""
    backend = values.get("backend", old.get("backend", L3Section.backend))
    out = route_l3_keys(values, backend)
    for key, table in out.items():
        if isinstance(table, Mapping):
            out[key] = {**old.get(key, {}), **table}
    return out


def route_l3_keys(values: Mapping[str, Any], backend: str | None = None) -> dict:
    """``[l3]`` keys in the layout of tables: a flat backend key (``path``, ``url``, ...)
    moves into ``[l3.<its backend>]`` (the selected ``backend`` first, then any that has it);
    unknown keys stay where they are, for the validation to name them."""
    from .l3 import registry
    own = {f.name for f in dataclasses.fields(L3Section) if not f.metadata.get("table")}
    backend = backend or values.get("backend", L3Section.backend)
    out: dict = {}
    for key, value in values.items():
        owner = None if key in own or isinstance(value, Mapping) else \
            _legacy_owner(key, backend, registry)
        if owner is None:
            out[key] = {**out.get(key, {}), **value} if isinstance(value, Mapping) else value
        else:
            out.setdefault(owner, {})[key] = value
    return out


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; expected one of {', '.join(options)}"


def raise_all(errors: list[str]) -> None:
    """One ConfigError naming every error found (``.errors`` lists them); none: nothing."""
    if not errors:
        return
    e = ConfigError(errors[0] if len(errors) == 1 else
                    f"{len(errors)} errors: " + "; ".join(errors))
    e.errors = list(errors)
    raise e


def _value_error(full: str, f: dataclasses.Field, value: Any) -> str | None:
    """What is wrong with ``value`` for the key ``full`` (its type, choices, range), or None."""
    meta = f.metadata
    want = meta.get("type") or type(f.default)
    # bool is an int in Python: never accept it where a number is meant, and vice versa
    if isinstance(value, bool) != (want is bool) or not isinstance(value, want):
        names = " or ".join(t.__name__ for t in (want if isinstance(want, tuple) else (want,)))
        return f"{full}: expected {names}, got {type(value).__name__} {value!r}"
    if meta.get("choices") and value not in meta["choices"]:
        return (f"{full}: {value!r} is not one of "
                f"{', '.join(repr(c) for c in meta['choices'])}")
    lo, hi = meta.get("min"), meta.get("max")
    if value != value or (lo is not None and value < lo) or (hi is not None and value > hi):
        return f"{full}: {value!r} is out of range [{lo}, {hi}]"
    return None


def _build_section(section: str, kind: type, values: Mapping[str, Any]):
    fields = {f.name: f for f in dataclasses.fields(kind)}
    kwargs, errors = {}, []
    for key, value in values.items():
        full = f"{section}.{key}"
        if key not in fields:
            errors.append(f"{full}: unknown key{_suggest(key, fields)}")
            continue
        bad = _value_error(full, fields[key], value)
        if bad is None:
            kwargs[key] = value
        else:
            errors.append(bad)
    raise_all(errors)
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
    from .l3 import registry
    out = []
    for name, kind in SECTIONS.items():
        for f in dataclasses.fields(kind):
            if not f.metadata.get("table"):
                out.append((f"{name}.{f.name}", f.default, f.metadata.get("help", "")))
    for backend in registry.names():  # the [l3.<backend>] tables the registry declares
        for f in dataclasses.fields(registry.get(backend).section):
            out.append((f"l3.{backend}.{f.name}", f.default, f.metadata.get("help", "")))
    return out

