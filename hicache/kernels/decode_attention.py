"""Triton decode attention over MLA latent rows that also returns the log-sum-exp.

One program per (query token, block of heads, split of the keys): the single latent KV "head" is
loaded once per key block and shared by every head of the block (``tl.dot`` of [BLOCK_H, R] by
[R, BLOCK_N]). Keys are cut into splits (flash-decoding) so a one-token decode over a long shard
still fills the GPU; the splits' partial states are merged exactly with ``merge_attn_states``'
weights, in place into the one output (no partial-sized temporaries).
Causality uses global positions (``kv_pos <= q_pos``), so the kernel works on a DCP shard.

The torch reference is ``hicache.engine.attention.attend_latent_torch``; the kernel is tested
against it on CPU under ``TRITON_INTERPRET=1`` (where it loads, casts to fp32 and computes in
fp32, because the interpreter's bf16 arithmetic is wrong).
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:  # triton is optional: absent on some platforms, unusable without CUDA unless interpreted
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the platform
    triton = None
    tl = None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """True when the kernel can run here: triton imported and CUDA present (or interpreted)."""
    return triton is not None and (torch.cuda.is_available() or interpreted())


if triton is not None:

    @triton.jit
    def _load_queries(q_lat_ptr, q_pe_ptr, t, s_qt, s_qh, s_pt, s_ph, offs_h, offs_r, offs_d,
                      hmask, rmask, dmask, DOT_FP32: tl.constexpr):
        """Token ``t``'s queries of the block's heads: latent [BLOCK_H, BLOCK_R] and rotary
        [BLOCK_H, BLOCK_DR] (in fp32 with ``DOT_FP32``)."""
        q = tl.load(q_lat_ptr + t * s_qt + offs_h[:, None] * s_qh + offs_r[None, :],
                    mask=hmask[:, None] & rmask[None, :], other=0.0)
        qp = tl.load(q_pe_ptr + t * s_pt + offs_h[:, None] * s_ph + offs_d[None, :],
                     mask=hmask[:, None] & dmask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
            qp = qp.to(tl.float32)
        return q, qp

    @triton.jit
    def _load_keys(kv_ptr, rows_ptr, offs_n, nmask, s_kn, offs_r, offs_d, rmask, dmask,
                   R: tl.constexpr, DOT_FP32: tl.constexpr, INDIRECT: tl.constexpr):
        """Keys ``offs_n``'s latent [BLOCK_N, BLOCK_R] and rotary [BLOCK_N, BLOCK_DR] parts (in
        fp32 with ``DOT_FP32``); ``INDIRECT``: key n is row rows[n] of the pool layer."""
        if INDIRECT:  # no gathered copy
            krow = tl.load(rows_ptr + offs_n, mask=nmask, other=0).to(tl.int64)
        else:
            krow = offs_n
        c = tl.load(kv_ptr + krow[:, None] * s_kn + offs_r[None, :],
                    mask=nmask[:, None] & rmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
        kp = tl.load(kv_ptr + krow[:, None] * s_kn + R + offs_d[None, :],
                     mask=nmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_DR]
        if DOT_FP32:
            c = c.to(tl.float32)
            kp = kp.to(tl.float32)
        return c, kp

    @triton.jit
    def _scores(q, qp, c, kp, scale, allowed, DOT_FP32: tl.constexpr):
        """Scaled scores [BLOCK_H, BLOCK_N] of the heads against the keys (-inf where not
        ``allowed``)."""
        if DOT_FP32:
            s = tl.dot(q, tl.trans(c), input_precision="ieee")
            s += tl.dot(qp, tl.trans(kp), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(c))
            s += tl.dot(qp, tl.trans(kp))
        s = s * scale
        return tl.where(allowed[None, :], s, float("-inf"))

    @triton.jit
    def _online_softmax_step(s, c, m_i, l_i, acc, DOT_FP32: tl.constexpr):
        """One key block folded into the running max ``m_i``, sum ``l_i`` and output
        ``acc``; the new (m_i, l_i, acc)."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, c, input_precision="ieee")
        else:
            pv = tl.dot(p.to(c.dtype), c)
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    @triton.jit
    def _store_split(o_ptr, lse_ptr, sp, t, s_os, s_ot, s_oh, s_ls, s_lt, offs_h, offs_r,
                     hmask, rmask, m_i, l_i, acc):
        """The split's normalized output and log-sum-exp (-inf for a head with no key)."""
        has = l_i > 0.0
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        lse = tl.where(has, m_fin + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        tl.store(o_ptr + sp * s_os + t * s_ot + offs_h[:, None] * s_oh + offs_r[None, :], o,
                 mask=hmask[:, None] & rmask[None, :])
        tl.store(lse_ptr + sp * s_ls + t * s_lt + offs_h, lse, mask=hmask)

    @triton.jit
    def _latent_attn_kernel(
        q_lat_ptr, q_pe_ptr, kv_ptr, rows_ptr, q_pos_ptr, kv_pos_ptr, o_ptr, lse_ptr,
        N, H, scale,
        s_qt, s_qh, s_pt, s_ph, s_kn, s_os, s_ot, s_oh, s_ls, s_lt,
        split_len,
        R: tl.constexpr, DR: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
        BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, INDIRECT: tl.constexpr,
        LOOP_LEN: tl.constexpr,
    ):
        # 64-bit token, split and key indices: t * s_qt alone passes 2**31 at 32768 tokens of
        # 128 heads x 512 dims, and a product of int32 values wraps silently.
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        sp = tl.program_id(2).to(tl.int64)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_r = tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, BLOCK_DR)
        hmask = offs_h < H
        rmask = offs_r < R
        dmask = offs_d < DR

        q, qp = _load_queries(q_lat_ptr, q_pe_ptr, t, s_qt, s_qh, s_pt, s_ph, offs_h, offs_r,
                              offs_d, hmask, rmask, dmask, DOT_FP32)
        qpos = tl.load(q_pos_ptr + t)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        start = sp * split_len
        end = tl.minimum(start + split_len, N)
        # Triton 3.6's interpreter makes every assigned value a tensor, and turns a tensor loop
        # bound into a Python int by int() of a 1-element array, which numpy >= 2.4 refuses.
        # So, interpreted, the loop runs over the split length as a constant (LOOP_LEN, never
        # assigned; keys past the split's end masked); compiled (LOOP_LEN = 0) over
        # [start, end) with runtime bounds (the conditions are constexpr: resolved statically).
        for n0 in range(0 if LOOP_LEN > 0 else start, LOOP_LEN if LOOP_LEN > 0 else end,
                        BLOCK_N):
            # int64, as start is: offs_n * s_kn
            offs_n = (start if LOOP_LEN > 0 else 0) + n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < end
            kpos = tl.load(kv_pos_ptr + offs_n, mask=nmask, other=0)
            allowed = nmask & (kpos <= qpos)
            c, kp = _load_keys(kv_ptr, rows_ptr, offs_n, nmask, s_kn, offs_r, offs_d, rmask,
                               dmask, R, DOT_FP32, INDIRECT)
            s = _scores(q, qp, c, kp, scale, allowed, DOT_FP32)
            m_i, l_i, acc = _online_softmax_step(s, c, m_i, l_i, acc, DOT_FP32)

        _store_split(o_ptr, lse_ptr, sp, t, s_os, s_ot, s_oh, s_ls, s_lt, offs_h, offs_r,
                     hmask, rmask, m_i, l_i, acc)


_LAST: dict[bool, object] = {}  # DOT_FP32 -> the compiled kernel last launched


def register_spills(dot_fp32: bool) -> int | None:
    """Registers the kernel last launched with ``dot_fp32`` spills (bytes per thread, from
    Triton's compiled kernel); None when it has not run compiled here (interpreted, or never)."""
    k = _LAST.get(dot_fp32)
    n = getattr(k, "n_spills", None)
    return None if n is None else int(n)


def launch_config(block_r: int, dot_fp32: bool) -> tuple[int, int]:
    """(BLOCK_N, num_warps). Interpreted: 16 keys a block (the interpreter is slow). Compiled
    fp32 (exact dots) uses 8 warps: with 4, its [16, 512] fp32 tiles spill KBs of registers
    per thread (7 KB stack at BLOCK_N=32 on sm_90, triton 3.7.1; 0 with 8 warps; checked on
    CPU by tests/test_kernel_ir.py)."""
    if interpreted():
        return 16, 4
    return (32 if block_r >= 256 else 64), (8 if dot_fp32 else 4)


def _next_pow2(x: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (x - 1).bit_length()))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_splits(n: int, t: int, head_blocks: int, block_n: int, device: torch.device) -> int:
    blocks = max(1, math.ceil(n / block_n))
    if device.type != "cuda":
        return min(blocks, 2)  # interpreted: keep it tiny but still exercise the split merge
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = max(1, (2 * sms) // max(1, t * head_blocks))
    return max(1, min(blocks, want, 64))


def decode_attention_latent(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                            q_pos: torch.Tensor, kv_pos: torch.Tensor, scale: float,
                            kv_lora_rank: int, num_splits: int | None = None,
                            block_n: int | None = None, rows: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``attend_latent``: o [T, H, R] fp32, lse [T, H] fp32 (natural log).
    ``rows`` int64 [N]: the keys are ``kv[rows]``, read in place (no gathered copy)."""
    if triton is None:
        raise RuntimeError("triton is not installed; use the torch attention path")
    t, h, r = q_lat.shape
    dr = q_pe.shape[2]
    n = kv.shape[0] if rows is None else rows.shape[0]
    dev = kv.device
    if t == 0 or n == 0:  # nothing to attend: the empty result, made only here
        return (torch.zeros(t, h, r, dtype=torch.float32, device=dev),
                torch.full((t, h), -math.inf, dtype=torch.float32, device=dev))
    dot_fp32 = interpreted() or kv.dtype == torch.float32
    qdt = torch.float32 if dot_fp32 else kv.dtype
    q_lat = q_lat.to(qdt).contiguous()
    q_pe = q_pe.to(qdt).contiguous()
    kv = kv.contiguous()
    q_pos = q_pos.to(device=dev, dtype=torch.int64).contiguous()
    kv_pos = kv_pos.to(device=dev, dtype=torch.int64).contiguous()
    rows_arg = kv_pos if rows is None else rows.to(device=dev, dtype=torch.int64).contiguous()

    block_h = 16
    block_r = _next_pow2(r)
    block_dr = _next_pow2(dr)
    auto_n, num_warps = launch_config(block_r, dot_fp32)
    block_n = block_n or auto_n
    head_blocks = math.ceil(h / block_h)
    splits = num_splits or _num_splits(n, t, head_blocks, block_n, dev)
    split_len = math.ceil(math.ceil(n / splits) / block_n) * block_n
    splits = math.ceil(n / split_len)

    o_part = torch.empty(splits, t, h, r, dtype=torch.float32, device=dev)
    lse_part = torch.empty(splits, t, h, dtype=torch.float32, device=dev)
    grid = (t, head_blocks, splits)
    compiled = _latent_attn_kernel[grid](
        q_lat, q_pe, kv, rows_arg, q_pos, kv_pos, o_part, lse_part,
        n, h, float(scale),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1),
        split_len,
        R=r, DR=dr, BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_DR=block_dr, BLOCK_N=block_n,
        DOT_FP32=dot_fp32, INDIRECT=rows is not None,
        LOOP_LEN=split_len if interpreted() else 0, num_warps=num_warps,
    )
    _LAST[dot_fp32] = compiled
    if splits == 1:
        return o_part[0], lse_part[0]
    return _merge_splits(o_part, lse_part)


def _merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' partial states merged exactly (``merge_attn_states``' weights) into one new
    output, accumulated in place: no temporary the size of the partials (the general merge
    makes two, 17 GB each for a 32K-token extend). The kernel writes o = 0 and lse = -inf for
    a split without keys, so its weight is 0 and nothing needs masking."""
    from hicache.kernels.merge import merge_weights

    w, lse = merge_weights(lse_part)  # [splits, T, H], [T, H]
    out = torch.mul(o_part[0], w[0, ..., None])
    for i in range(1, o_part.shape[0]):
        out.addcmul_(o_part[i], w[i, ..., None])
    return out, lse
