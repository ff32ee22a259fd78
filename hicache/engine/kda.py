"""Kimi Delta Attention (KDA): the math of one request's tokens, in torch (fp32, no I/O).

A KDA layer keeps, per request, a state that summarises every token so far:

- ``conv`` [C, K-1]: the last K-1 inputs of the depthwise causal convolution (kernel K) over
  the q|k|v projections (C = 3 * heads * head_dim);
- ``rec`` [H, Dk, Dv] fp32: the recurrent matrix of every head.

For each token t (after the convolution and SiLU; q and k L2-normalised per head, q scaled by
1/sqrt(Dk); ``g`` [H, Dk] a per-channel log-decay, ``beta`` [H] a write strength):

    S = S * exp(g_t)[:, :, None]               # decay each key channel
    S = S + k_t ⊗ (beta_t * (v_t - k_t^T S))   # delta rule: write the error of S's recall
    o_t = q_t^T S                              # read

``kda_recurrent`` runs that token loop (the reference); ``kda_chunked`` computes the same a
chunk of tokens at a time with matrix products and one triangular solve per chunk (prefill).
``short_conv`` runs the convolution from a state, returning the next state. ``forget_gate``
turns the gate projection into ``g``: ``-exp(A_log) * softplus(raw + dt_bias)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution then SiLU. x [T, C] fp32, weight [C, K], state [C, K-1]
    (the previous K-1 inputs, zeros for a new request) -> (y [T, C] fp32, next state
    [C, K-1] fp32)."""
    k = weight.shape[-1]
    full = torch.cat([state.float(), x.float().T], 1)  # [C, K-1+T]
    y = F.conv1d(full[None], weight.float()[:, None, :], groups=full.shape[0])[0]  # [C, T]
    return F.silu(y).T, full[:, full.shape[1] - (k - 1):]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (eps inside the root, as FLA's kernel)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def forget_gate(raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """raw [T, H, Dk] fp32, a_log [H], dt_bias [H*Dk] -> log-decay g [T, H, Dk] (<= 0)."""
    x = raw + dt_bias.float().view(1, *raw.shape[1:])
    soft = torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))
    return -torch.exp(a_log.float()).view(1, -1, 1) * soft


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token loop. q, k [T, H, Dk] (normalised; q scaled), v [T, H, Dv], g [T, H, Dk],
    beta [T, H], state [H, Dk, Dv] fp32 -> (o [T, H, Dv] fp32, next state [H, Dk, Dv] fp32).
    ``state`` is not modified."""
    s = state.float().clone()
    decay = g.float().exp()
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32,
                      device=q.device)
    for t in range(q.shape[0]):
        s = s * decay[t][:, :, None]
        recall = torch.einsum("hk,hkv->hv", k[t], s)
        delta = (v[t] - recall) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)
    return out, s


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor, chunk: int = 32
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``kda_recurrent`` a chunk of tokens at a time (same arguments and results).

    Within a chunk, with G_t the cumulative log-decay up to token t (per key channel) and
    S0 the state at the chunk start, the written values u_t = beta_t (v_t - k_t^T S_{t-1}')
    solve the unit lower-triangular system

        u_t + sum_{s<t} beta_t (k_t . e^(G_t - G_s) k_s) u_s = beta_t (v_t - (e^(G_t) k_t)^T S0)

    then o_t = (e^(G_t) q_t)^T S0 + sum_{s<=t} (q_t . e^(G_t - G_s) k_s) u_s and the state
    after the chunk is e^(G_n) S0 + sum_s (e^(G_n - G_s) k_s) u_s^T. Only differences
    G_t - G_s with s <= t appear (all <= 0): no overflow however strong the decay."""
    n_tok, heads = q.shape[0], q.shape[1]
    s = state.float().clone()
    out = torch.empty(n_tok, heads, v.shape[-1], dtype=torch.float32, device=q.device)
    for c0 in range(0, n_tok, chunk):
        c1 = min(n_tok, c0 + chunk)
        n = c1 - c0
        qc, kc, vc, gc = (x[c0:c1].float().transpose(0, 1) for x in (q, k, v, g))  # [H, n, D]
        bc = beta[c0:c1].float().T  # [H, n]
        big = gc.cumsum(1)  # G [H, n, Dk]
        low = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        diff = (big[:, :, None, :] - big[:, None, :, :]).masked_fill(~low[None, :, :, None],
                                                                     float("-inf"))
        kd = kc[:, None, :, :] * diff.exp()  # e^(G_t - G_s) k_s at [h, t, s]
        kk = torch.einsum("htd,htsd->hts", kc, kd)
        qk = torch.einsum("htd,htsd->hts", qc, kd)
        eye = torch.eye(n, device=q.device)
        a = eye + (bc[:, :, None] * kk) * (~eye.bool())  # unit lower triangular
        eg = big.exp()
        rhs = bc[:, :, None] * (vc - torch.einsum("htd,hdv->htv", kc * eg, s))
        u = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        out[c0:c1] = (torch.einsum("htd,hdv->htv", qc * eg, s) + qk @ u).transpose(0, 1)
        tail = (big[:, -1:, :] - big).exp() * kc  # e^(G_n - G_s) k_s [H, n, Dk]
        s = eg[:, -1, :, None] * s + torch.einsum("hsd,hsv->hdv", tail, u)
    return out, s


def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """Per-head RMSNorm of o [T, H, Dv] times sigmoid(gate [T, H, Dv]) (fp32)."""
    o = o.float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return o * torch.sigmoid(gate.float())
