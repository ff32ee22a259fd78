"""``PageFormat``: what one rank stores of one logical page, in one format. Pure: no I/O.

A logical page id names ``P*c`` token positions; the cache may keep several things for them,
each in its own format (docs/page-format.md):

- ``STRIPED`` token rows: the target MLA KV. Each DCP rank holds only the rows it owns:
  ``rows = P`` per page per rank.
- ``REPLICATED`` token rows: e.g. a draft model's KV. Every rank holds every row:
  ``rows = P*c``.
- ``STATE``: not token rows at all, e.g. a hybrid model's recurrent / short-conv state after
  the page's last position. Replicated on every rank; each layer's snapshot is ``rows`` rows of
  ``row_width`` elements (``rows = 1``: the whole snapshot flattened into one row).

Every size the tiers use (a pool's tensor shape, a page's bytes, an L3 value's size, the memory
a config needs) is a property of the format: no tier multiplies layers by rows by width again.
A pool stores a page as ``[layers, rows, row_width]`` of ``dtype``; ``encoding`` names how those
elements encode the values (``"raw"``: as they are). Conversions between two formats' dtypes
are declared in ``CONVERSIONS``; the transfer engine refuses any other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from .checks import check_int
from .errors import UsageError

ENCODINGS = ("raw",)


class PageKind(enum.Enum):
    STRIPED = "striped"        # token rows; rank r holds the rows it owns (P per page)
    REPLICATED = "replicated"  # token rows; every rank holds all of them (P*c per page)
    STATE = "state"            # a snapshot, not token rows; the same on every rank


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    raise UsageError(f"dtype must be a torch.dtype or its name, got {dtype!r}")


def dtype_name(dtype: torch.dtype | str) -> str:
    """The dtype's name without ``torch.``: ``"bfloat16"``."""
    return str(as_dtype(dtype)).removeprefix("torch.")


@dataclass(frozen=True)
class PageFormat:
    """One rank's share of one logical page in one format: ``layers`` blocks of ``rows`` rows
    of ``row_width`` elements of ``dtype``."""

    name: str
    kind: PageKind
    layers: int
    rows: int       # rows per page per rank (P striped, P*c replicated, snapshot rows)
    row_width: int  # elements per row
    dtype: torch.dtype
    encoding: str = "raw"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise UsageError(f"a page format's name must be an identifier, got {self.name!r}")
        if not isinstance(self.kind, PageKind):
            try:
                object.__setattr__(self, "kind", PageKind(self.kind))
            except ValueError:
                raise UsageError(f"page format {self.name!r}: kind must be one of "
                                 f"{[k.value for k in PageKind]}, got {self.kind!r}") from None
        for key in ("layers", "rows", "row_width"):
            check_int(getattr(self, key), f"page format {self.name!r}: {key}", error=UsageError)
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        if self.dtype.is_complex or self.dtype == torch.bool:
            raise UsageError(f"page format {self.name!r}: dtype {self.dtype} cannot hold pages")
        if self.encoding not in ENCODINGS:
            raise UsageError(f"page format {self.name!r}: encoding must be one of {ENCODINGS}, "
                             f"got {self.encoding!r}")

    # ---- constructors ---------------------------------------------------------------------------
    @classmethod
    def striped_kv(cls, layers: int, page_size: int, kv_dim: int,
                   dtype: torch.dtype | str, name: str = "kv") -> "PageFormat":
        """The target MLA KV: each rank holds its own ``page_size`` (P) rows of every page."""
        return cls(name, PageKind.STRIPED, layers, page_size, kv_dim, dtype)

    @classmethod
    def replicated(cls, layers: int, page_size: int, dcp_size: int, row_width: int,
                   dtype: torch.dtype | str, name: str = "draft") -> "PageFormat":
        """Token rows every rank holds in full (a draft's KV): ``P*c`` rows per page."""
        check_int(page_size, "page_size", error=UsageError)
        check_int(dcp_size, "dcp_size", error=UsageError)
        return cls(name, PageKind.REPLICATED, layers, page_size * dcp_size, row_width, dtype)

    @classmethod
    def state(cls, layers: int, elems: int, dtype: torch.dtype | str, name: str = "state",
              rows: int = 1) -> "PageFormat":
        """A state snapshot of ``elems`` elements per layer, as ``rows`` rows (``elems`` must
        divide into them evenly)."""
        check_int(elems, "elems", error=UsageError)
        check_int(rows, "rows", error=UsageError)
        if elems % rows:
            raise UsageError(f"page format {name!r}: {elems} state elements do not split into "
                             f"{rows} rows")
        return cls(name, PageKind.STATE, layers, rows, elems // rows, dtype)

    def with_dtype(self, dtype: torch.dtype | str) -> "PageFormat":
        """The same format with another element type (a host copy kept wider, say)."""
        return replace(self, dtype=as_dtype(dtype))

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def block_elems(self) -> int:
        """Elements of one page-layer block (``rows * row_width``)."""
        return self.rows * self.row_width

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.itemsize

    @property
    def layer_bytes(self) -> int:
        """Bytes of one page-layer block on one rank."""
        return self.rows * self.row_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page on one rank (every layer)."""
        return self.layers * self.layer_bytes

    @property
    def shape(self) -> tuple[int, int, int]:
        """One page on one rank: ``(layers, rows, row_width)``."""
        return (self.layers, self.rows, self.row_width)

    def pool_shape(self, num_pages: int, page_major: bool = False) -> tuple[int, ...]:
        """A pool of ``num_pages`` pages: ``[layers, num_pages * rows, row_width]``, or
        ``[num_pages, layers, rows, row_width]`` when a page's layers are adjacent."""
        check_int(num_pages, "num_pages", 0, error=UsageError)
        if page_major:
            return (num_pages, *self.shape)
        return (self.layers, num_pages * self.rows, self.row_width)

    def pool_bytes(self, num_pages: int) -> int:
        return check_int(num_pages, "num_pages", 0, error=UsageError) * self.page_bytes

    @property
    def token_rows(self) -> bool:
        """Rows are token positions (striped or replicated), addressable by slot."""
        return self.kind is not PageKind.STATE

    @property
    def striped(self) -> bool:
        return self.kind is PageKind.STRIPED

    def same_shape(self, other: "PageFormat") -> bool:
        """Same kind, layers, rows and width (the dtype and encoding may differ)."""
        return (self.kind, self.shape) == (other.kind, other.shape)

    def describe(self) -> str:
        return (f"{self.name}: {self.kind.value} {self.layers} layers x {self.rows} rows x "
                f"{self.row_width} {dtype_name(self.dtype)} ({self.encoding}), "
                f"{self.page_bytes} bytes per page per rank")



class FormatSized:
    """The sizes of a pool of ``num_pages`` pages of one ``PageFormat`` (``self.format``), read
    from the format: their one home, for the L1 and L2 pools alike."""

    format: PageFormat
    num_pages: int

    @property
    def num_layers(self) -> int:
        return self.format.layers

    @property
    def kv_dim(self) -> int:
        return self.format.row_width

    @property
    def dtype(self) -> torch.dtype:
        return self.format.dtype

    @property
    def rows_per_page(self) -> int:
        return self.format.rows

    @property
    def bytes_per_page(self) -> int:
        """This rank's bytes for one page across all layers."""
        return self.format.page_bytes

    @property
    def nbytes(self) -> int:
        return self.format.pool_bytes(self.num_pages)

# ---- conversions between formats' dtypes -------------------------------------------------------
@dataclass(frozen=True)
class Conversion:
    """A declared element conversion ``src -> dst``. ``exact``: every ``src`` value is a ``dst``
    value (widening), so a round trip ``src -> dst -> src`` gives the same bits."""

    src: torch.dtype
    dst: torch.dtype
    exact: bool


_WIDER = {torch.bfloat16: (torch.float32, torch.float64),
          torch.float16: (torch.float32, torch.float64),
          torch.float32: (torch.float64,)}
CONVERSIONS: dict[tuple[torch.dtype, torch.dtype], Conversion] = {}
for _narrow, _wides in _WIDER.items():
    for _wide in _wides:
        CONVERSIONS[(_narrow, _wide)] = Conversion(_narrow, _wide, exact=True)
        # narrowing back is exact for values that came from the narrow type (rounds otherwise)
        CONVERSIONS[(_wide, _narrow)] = Conversion(_wide, _narrow, exact=False)


def conversion(src: PageFormat, dst: PageFormat) -> Conversion | None:
    """How pages of ``src`` become pages of ``dst``: None when no element changes (same dtype
    and encoding); a declared ``Conversion``; else UsageError naming both."""
    if not src.same_shape(dst):
        raise UsageError(f"page formats differ in shape: {src.describe()} vs {dst.describe()}")
    if src.encoding != dst.encoding:
        raise UsageError(f"no conversion from encoding {src.encoding!r} to {dst.encoding!r}")
    if src.dtype == dst.dtype:
        return None
    try:
        return CONVERSIONS[(src.dtype, dst.dtype)]
    except KeyError:
        raise UsageError(f"no declared conversion from {src.dtype} to {dst.dtype} "
                         f"(page format {src.name!r})") from None


# ---- the formats of one logical page -----------------------------------------------------------
@dataclass(frozen=True)
class FormatSet:
    """The formats a cache holds under one logical page id: the striped target KV, always, and
    its companions (a draft's KV, a state snapshot), each with its own name."""

    target: PageFormat
    companions: tuple[PageFormat, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.target, PageFormat) or not self.target.striped:
            raise UsageError(f"the target format must be a striped PageFormat, got "
                             f"{self.target!r}")
        object.__setattr__(self, "companions", tuple(self.companions))
        names = [f.name for f in self]
        for f in self.companions:
            if not isinstance(f, PageFormat):
                raise UsageError(f"a companion format must be a PageFormat, got {f!r}")
            if f.striped:
                raise UsageError(f"companion format {f.name!r} is striped; only the target KV "
                                 "is striped (a draft's KV and state are replicated)")
        if len(set(names)) != len(names):
            raise UsageError(f"page format names repeat: {names}")

    def __iter__(self) -> Iterator[PageFormat]:
        yield self.target
        yield from self.companions

    def __len__(self) -> int:
        return 1 + len(self.companions)

    def __getitem__(self, name: str) -> PageFormat:
        for f in self:
            if f.name == name:
                return f
        raise KeyError(f"no page format {name!r}; this cache holds {self.names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self)

    @property
    def page_bytes(self) -> int:
        """Bytes of one logical page on one rank, every format together."""
        return sum(f.page_bytes for f in self)
