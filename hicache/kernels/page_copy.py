"""Page gather/scatter between two KV buffers, as a Triton kernel and a torch reference.

Both buffers are seen as ``[B, R, W]`` (B = layers, R = pages or rows, W = elements per
page/row; the last dim contiguous, other strides free). For every ``i`` and every ``b``:

    dst[b, dst_idx[i], :] = src[b, src_idx[i], :]

One launch moves many scattered pages of all layers, in one pass (no temporary). On CUDA the
host side is pinned memory, which the kernel reads or writes directly through unified
addressing. Copies are bit-exact (no arithmetic), so the Triton interpreter is exact too.
"""

from __future__ import annotations

import os

import torch

from hicache.errors import UsageError

try:  # triton is a dependency on linux x86_64 only
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - platform without triton
    triton = None
    tl = None
    HAVE_TRITON = False


def _as3d(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3:
        raise UsageError(f"{name} must be [R, W] or [B, R, W], got {list(t.shape)}")
    if t.shape[2] > 1 and t.stride(2) != 1:
        raise UsageError(f"{name} must be contiguous in its last dim, strides {t.stride()}")
    return t


def _check(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor,
           dst_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if src.dtype != dst.dtype:
        raise UsageError(f"src dtype {src.dtype} != dst dtype {dst.dtype}")
    s, d = _as3d(src, "src"), _as3d(dst, "dst")
    if s.shape[0] != d.shape[0] or s.shape[2] != d.shape[2]:
        raise UsageError(f"src {list(s.shape)} and dst {list(d.shape)} disagree on B or W")
    if src_idx.dim() != 1 or dst_idx.dim() != 1 or src_idx.numel() != dst_idx.numel():
        raise UsageError(f"index lists must be 1-D of equal length, got "
                         f"{list(src_idx.shape)} and {list(dst_idx.shape)}")
    return s, d


def page_copy_reference(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor,
                        dst_idx: torch.Tensor) -> None:
    """Torch reference: gather then scatter (two passes), same semantics as the kernel."""
    s, d = _check(src, src_idx, dst, dst_idx)
    if src_idx.numel() == 0:
        return
    gathered = s.index_select(1, src_idx.to(s.device))
    d.index_copy_(1, dst_idx.to(d.device), gathered.to(d.device))


if HAVE_TRITON:

    @triton.jit
    def _page_copy_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, W,
                          s_b, s_r, d_b, d_r, BLOCK: tl.constexpr):
        i = tl.program_id(0)  # which (src_idx, dst_idx) pair
        b = tl.program_id(1)  # which layer
        blk = tl.program_id(2)  # which chunk of the W elements
        si = tl.load(src_idx_ptr + i).to(tl.int64)
        di = tl.load(dst_idx_ptr + i).to(tl.int64)
        cols = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < W
        bb = b.to(tl.int64)
        vals = tl.load(src_ptr + bb * s_b + si * s_r + cols, mask=mask)
        tl.store(dst_ptr + bb * d_b + di * d_r + cols, vals, mask=mask)


# triton.jit picks the interpreter when the kernel is decorated (at import), so remember that.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_enabled() -> bool:
    """Whether the kernel in this process was built for the Triton interpreter."""
    return HAVE_TRITON and _INTERPRETED


def kernel_usable() -> bool:
    """Whether ``page_copy_triton`` can run here: CUDA present, or the Triton interpreter."""
    if not HAVE_TRITON:
        return False
    return interpreter_enabled() or torch.cuda.is_available()


def page_copy_triton(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor,
                     dst_idx: torch.Tensor, block: int = 1024) -> None:
    """Triton kernel: ``dst[:, dst_idx] = src[:, src_idx]`` in one launch.

    Index tensors must live where the kernel runs (CUDA, or CPU under the interpreter); on CUDA
    a CPU-side src/dst must be pinned (reached via unified addressing).
    """
    if not HAVE_TRITON:
        raise UsageError("triton is not installed on this platform")
    s, d = _check(src, src_idx, dst, dst_idx)
    n, B, W = src_idx.numel(), s.shape[0], s.shape[2]
    if n == 0 or B == 0 or W == 0:
        return
    block = min(block, triton.next_power_of_2(W))
    grid = (n, B, triton.cdiv(W, block))
    _page_copy_kernel[grid](s, d, src_idx, dst_idx, W, s.stride(0), s.stride(1),
                            d.stride(0), d.stride(1), BLOCK=block)
