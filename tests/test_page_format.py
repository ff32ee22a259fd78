"""PageFormat: pure checks (sizes against real tensors, the kinds, conversions, FormatSet)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import UsageError
from hicache.page_format import (CONVERSIONS, FormatSet, PageFormat, PageKind, as_dtype,
                                 conversion, dtype_name)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.float64,
          torch.float8_e4m3fn, torch.int32]
small = st.integers(1, 9)


@settings(max_examples=60, deadline=None)
@given(layers=small, p=small, c=st.integers(1, 4), width=small, pages=st.integers(0, 5),
       dtype=st.sampled_from(DTYPES), page_major=st.booleans())
def test_sizes_agree_with_real_tensors(layers, p, c, width, pages, dtype, page_major):
    for fmt in (PageFormat.striped_kv(layers, p, width, dtype),
                PageFormat.replicated(layers, p, c, width, dtype)):
        page = torch.empty(fmt.shape, dtype=dtype)
        assert page.nbytes == fmt.page_bytes
        assert page[0].nbytes == fmt.layer_bytes and page[0, 0].nbytes == fmt.row_bytes
        assert page[0].numel() == fmt.block_elems
        pool = torch.empty(fmt.pool_shape(pages, page_major), dtype=dtype)
        assert pool.nbytes == fmt.pool_bytes(pages) == pages * fmt.page_bytes
    # striped: P rows per rank; replicated: every rank holds the whole widened page
    assert PageFormat.striped_kv(layers, p, width, dtype).rows == p
    assert PageFormat.replicated(layers, p, c, width, dtype).rows == p * c


@settings(max_examples=40, deadline=None)
@given(layers=small, rows=small, width=small, dtype=st.sampled_from(DTYPES))
def test_state_format_holds_a_snapshot(layers, rows, width, dtype):
    fmt = PageFormat.state(layers, rows * width, dtype, rows=rows)
    assert fmt.kind is PageKind.STATE and not fmt.token_rows and not fmt.striped
    assert (fmt.rows, fmt.row_width) == (rows, width)
    snapshot = torch.empty(layers, rows * width, dtype=dtype)  # one flat snapshot per layer
    assert snapshot.nbytes == fmt.page_bytes
    assert PageFormat.state(layers, rows * width, dtype).shape == (layers, 1, rows * width)


def test_kinds_dtypes_and_bad_values():
    f = PageFormat.striped_kv(2, 4, 8, "bfloat16")
    assert f.dtype is torch.bfloat16 and f.kind is PageKind.STRIPED and f.encoding == "raw"
    assert PageFormat("kv", "striped", 2, 4, 8, torch.bfloat16) == f  # kind by value
    assert f.with_dtype(torch.float32).page_bytes == 2 * f.page_bytes
    assert as_dtype("torch.float16") is torch.float16 and dtype_name(torch.float16) == "float16"
    assert "striped 2 layers x 4 rows x 8 bfloat16" in f.describe()
    for bad, match in [(dict(layers=0), "layers"), (dict(rows=True), "rows"),
                       (dict(row_width=-1), "row_width"), (dict(dtype="bf17"), "dtype"),
                       (dict(dtype=torch.complex64), "cannot hold"),
                       (dict(encoding="zstd"), "encoding"), (dict(kind="ring"), "kind"),
                       (dict(name="a b"), "identifier")]:
        args = dict(name="kv", kind=PageKind.STRIPED, layers=2, rows=4, row_width=8,
                    dtype=torch.float16)
        with pytest.raises(UsageError, match=match):
            PageFormat(**{**args, **bad})
    with pytest.raises(UsageError, match="do not split"):
        PageFormat.state(2, 10, torch.float32, rows=3)


def test_declared_conversions():
    bf = PageFormat.striped_kv(2, 4, 8, torch.bfloat16)
    assert conversion(bf, bf) is None
    up = conversion(bf, bf.with_dtype(torch.float32))
    assert up.exact and not conversion(bf.with_dtype(torch.float32), bf).exact
    with pytest.raises(UsageError, match="no declared conversion"):
        conversion(bf, bf.with_dtype(torch.float16))  # neither holds the other's values
    with pytest.raises(UsageError, match="differ in shape"):
        conversion(bf, PageFormat.striped_kv(2, 4, 16, torch.bfloat16))
    with pytest.raises(UsageError, match="differ in shape"):
        conversion(bf, PageFormat.replicated(2, 4, 1, 8, torch.bfloat16))
    # every conversion declared exact really is: all values of the narrow type survive it
    for (src, dst), conv in CONVERSIONS.items():
        if conv.exact:
            bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
            vals = bits.view(src) if src.itemsize == 2 else torch.randn(4096, dtype=src)
            vals = vals[~vals.isnan()]
            assert torch.equal(vals.to(dst).to(src), vals), (src, dst)


def test_format_set():
    kv = PageFormat.striped_kv(4, 16, 576, torch.bfloat16)
    draft = PageFormat.replicated(1, 16, 4, 576, torch.bfloat16)
    state = PageFormat.state(3, 1000, torch.float32)
    fs = FormatSet(kv, (draft, state))
    assert fs.names == ("kv", "draft", "state") and len(fs) == 3 and list(fs)[0] is kv
    assert fs["draft"] is draft and fs.page_bytes == kv.page_bytes + draft.page_bytes + 12000
    assert FormatSet(kv).page_bytes == kv.page_bytes
    with pytest.raises(KeyError, match="no page format 'mtp'"):
        fs["mtp"]
    with pytest.raises(UsageError, match="target format must be a striped"):
        FormatSet(draft)
    with pytest.raises(UsageError, match="only the target KV is striped"):
        FormatSet(kv, (PageFormat.striped_kv(1, 16, 8, torch.bfloat16, name="other"),))
    with pytest.raises(UsageError, match="names repeat"):
        FormatSet(kv, (draft, PageFormat.state(1, 8, torch.float32, name="draft")))
