"""Parallel topology rules: TP / attention-DP / DCP / kv-head. Pure math, no I/O.

    attn_tp = tp / attn_dp                    (tp % attn_dp == 0)
    attn_tp % dcp == 0                        (a DCP group sits inside one attention-TP group)
    1 <= dcp <= max(1, attn_tp // H)          (DCP only removes duplication; it adds no GPUs)
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import check_int
from .errors import TopologyError


@dataclass(frozen=True)
class KVShape:
    """Per-token KV shape of a model. MLA: one latent "head" (num_kv_heads = 1) of
    kv_lora_rank + rope_dim; GQA: num_kv_heads heads of K and V, head_dim each."""

    name: str
    num_layers: int
    attention: str  # "mla" | "gqa"
    num_kv_heads: int
    kv_lora_rank: int = 0
    rope_dim: int = 0
    head_dim: int = 0
    dtype: str = "bfloat16"  # the KV element type; its size comes from hicache.page_format

    def __post_init__(self) -> None:
        if self.attention not in ("mla", "gqa"):
            raise TopologyError(f"attention must be 'mla' or 'gqa', got {self.attention!r}")
        if self.attention == "mla" and self.num_kv_heads != 1:
            raise TopologyError("an MLA model has exactly one latent KV head")
        for name in ("num_layers", "num_kv_heads"):
            check_int(getattr(self, name), name, error=TopologyError)
        if self.row_elems_per_head < 1:
            raise TopologyError(f"model {self.name!r} has an empty KV row")

    def page_format(self, tp_size: int = 1, page_size: int = 1):
        """The ``PageFormat`` of one rank's share of a page: ``page_size`` rows per rank of the
        kv heads this rank holds under TP (at least one: duplicated when tp > H)."""
        from .errors import UsageError
        from .page_format import PageFormat
        _positive("tp_size", tp_size)
        heads = max(1, -(-self.num_kv_heads // tp_size))  # ceil; duplicated when tp > H
        try:
            return PageFormat.striped_kv(self.num_layers, page_size,
                                         heads * self.row_elems_per_head, self.dtype)
        except UsageError as e:
            raise TopologyError(f"model {self.name!r}: {e}") from None

    @property
    def dtype_bytes(self) -> int:
        return self.page_format().itemsize

    @property
    def row_elems_per_head(self) -> int:
        if self.attention == "mla":
            return self.kv_lora_rank + self.rope_dim
        return 2 * self.head_dim  # K and V

    @property
    def bytes_per_token(self) -> int:
        """Bytes of KV for one token across all layers and all heads (no parallelism)."""
        return self.page_format(1).page_bytes


MODELS: dict[str, KVShape] = {
    s.name: s
    for s in (
        KVShape("deepseek-r1", 61, "mla", 1, kv_lora_rank=512, rope_dim=64),
        KVShape("deepseek-v3", 61, "mla", 1, kv_lora_rank=512, rope_dim=64),
        KVShape("kimi-k2", 61, "mla", 1, kv_lora_rank=512, rope_dim=64),
        KVShape("qwen3-235b-a22b", 94, "gqa", 4, head_dim=128),
        KVShape("llama-3-70b", 80, "gqa", 8, head_dim=128),
    )
}


def get_model(name: str) -> KVShape:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise TopologyError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def _positive(name: str, value: int) -> None:
    check_int(value, name, error=TopologyError)


def max_dcp(tp_size: int, num_kv_heads: int, attn_dp_size: int = 1) -> int:
    """The largest DCP size that still only removes duplication."""
    return max(1, (tp_size // attn_dp_size) // num_kv_heads)


def validate(tp_size: int, dcp_size: int, num_kv_heads: int, attn_dp_size: int = 1) -> None:
    """Raise TopologyError naming the first broken rule."""
    for name, value in (("tp_size", tp_size), ("dcp_size", dcp_size),
                        ("num_kv_heads", num_kv_heads), ("attn_dp_size", attn_dp_size)):
        _positive(name, value)
    if tp_size % attn_dp_size:
        raise TopologyError(
            f"tp_size {tp_size} is not divisible by attn_dp_size {attn_dp_size} "
            "(rule: tp % attn_dp == 0)")
    attn_tp = tp_size // attn_dp_size
    if attn_tp % dcp_size:
        raise TopologyError(
            f"dcp_size {dcp_size} does not divide attn_tp_size {attn_tp} = tp {tp_size} / "
            f"attn_dp {attn_dp_size}: a DCP group would cross an attention replica "
            "(rule: attn_tp % dcp == 0, containment)")
    limit = max_dcp(tp_size, num_kv_heads, attn_dp_size)
    if dcp_size > limit:
        raise TopologyError(
            f"dcp_size {dcp_size} exceeds attn_tp / num_kv_heads = {limit}: DCP only removes "
            f"KV duplication and adds no GPUs (rule: 1 <= dcp <= max(1, attn_tp // H))")


def kv_duplication(tp_size: int, num_kv_heads: int, dcp_size: int = 1) -> float:
    """Copies of each KV row held inside one TP group."""
    _positive("tp_size", tp_size)
    _positive("num_kv_heads", num_kv_heads)
    _positive("dcp_size", dcp_size)
    return max(1, tp_size // num_kv_heads) / dcp_size


def kv_bytes_per_token(shape: KVShape, tp_size: int, dcp_size: int = 1) -> float:
    """KV bytes one rank stores per token of a request (heads split by TP, tokens by DCP)."""
    _positive("dcp_size", dcp_size)
    return shape.page_format(tp_size).page_bytes / dcp_size  # one token's row, 1/c of them


@dataclass(frozen=True)
class PlanRow:
    dcp: int
    duplication: float
    kv_bytes_per_token_per_rank: float
    tokens_per_rank_budget: int  # tokens of context one rank's budget holds (group-wide tokens)


def plan(shape: KVShape, tp_size: int, attn_dp_size: int = 1, memory_bytes: float = 0.0,
         dcp_size: int | None = None) -> list[PlanRow]:
    """Rows for DCP 1 and every valid DCP size (or just ``dcp_size``)."""
    validate(tp_size, 1, shape.num_kv_heads, attn_dp_size)
    limit = max_dcp(tp_size, shape.num_kv_heads, attn_dp_size)
    sizes = [d for d in range(1, limit + 1) if (tp_size // attn_dp_size) % d == 0]
    if dcp_size is not None:
        validate(tp_size, dcp_size, shape.num_kv_heads, attn_dp_size)
        sizes = sorted({1, dcp_size})
    rows = []
    for d in sizes:
        per_tok = kv_bytes_per_token(shape, tp_size, d)
        rows.append(PlanRow(d, kv_duplication(tp_size, shape.num_kv_heads, d), per_tok,
                            int(memory_bytes // per_tok) if memory_bytes else 0))
    return rows
