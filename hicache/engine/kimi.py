"""Kimi Linear: MLA layers (striped KV, the existing MLA path) interleaved with KDA layers.

    model = hicache.checkpoints.hf.load_model("path/to/kimi-linear")   # a KimiLinearModel
    model.cfg        # ModelConfig of the MLA part: num_layers = the MLA layers (the KV layers)
    model.hybrid     # HybridConfig: every layer's kind, MLP kind and the KDA shape
    model.kv_layer   # layer i -> its KV pool layer (MLA) or None (KDA)

An MLA layer is an ``MLALayer`` whose RoPE is the identity (Kimi Linear's MLA runs without
positional rotation; ``NoRotary``). A ``KDALayer`` holds the Kimi Delta Attention weights and the
same residual / feed-forward block; its state lives outside the model (``KDAStatePool``), so
``KDALayer.mix(x, conv, rec)`` is pure: normalised input and a state in, output and the next
state out. ``forward`` / ``generate`` are the dense single-process reference (every position
recomputed; KDA from zero state), as ``MLAModel``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from hicache.checks import check_int
from hicache.engine import kda
from hicache.engine.attention import attend_latent
from hicache.engine.model import MLALayer, MLAModel, ModelConfig, MoE, rms_norm
from hicache.errors import ConfigError, UsageError


@dataclass(frozen=True)
class HybridConfig:
    """The hybrid part of a Kimi Linear model: per-layer kinds and the KDA shape."""

    layer_types: tuple  # "full_attention" (MLA) | "linear_attention" (KDA), one per layer
    mlp_layer_types: tuple  # "dense" | "sparse", one per layer
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        for name in ("kda_heads", "kda_head_dim", "conv_kernel"):
            check_int(getattr(self, name), f"HybridConfig.{name}", error=ConfigError)
        if len(self.layer_types) != len(self.mlp_layer_types):
            raise ConfigError("HybridConfig: layer_types and mlp_layer_types differ in length")
        for i, kind in enumerate(self.layer_types):
            if kind not in ("full_attention", "linear_attention"):
                raise ConfigError(f"HybridConfig.layer_types[{i}] {kind!r} is not a known layer "
                                  "type")
        for i, kind in enumerate(self.mlp_layer_types):
            if kind not in ("dense", "sparse"):
                raise ConfigError(f"HybridConfig.mlp_layer_types[{i}] {kind!r} is unknown")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_types) if k == "linear_attention")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_types) if k == "full_attention")

    @property
    def kda_dim(self) -> int:
        """heads * head_dim: the width of q, k and v."""
        return self.kda_heads * self.kda_head_dim

    def conv_state_shape(self) -> tuple[int, int]:
        return (3 * self.kda_dim, self.conv_kernel - 1)

    def rec_state_shape(self) -> tuple[int, int, int]:
        return (self.kda_heads, self.kda_head_dim, self.kda_head_dim)

    def state_bytes_per_layer(self, conv_elem_bytes: int) -> int:
        """One request's KDA state in one layer: conv window (model dtype) + fp32 matrix."""
        c, w = self.conv_state_shape()
        h, dk, dv = self.rec_state_shape()
        return c * w * conv_elem_bytes + h * dk * dv * 4

    def snapshot_bytes(self, conv_elem_bytes: int) -> int:
        """One request's KDA state over every KDA layer (one snapshot)."""
        return len(self.kda_layers) * self.state_bytes_per_layer(conv_elem_bytes)


class NoRotary:
    """Kimi Linear's MLA: the "rope" parts of q and k are used as they are (fp32)."""

    interleave = False

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x.float()


def _p(*shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class KDALayer(nn.Module):
    """RMSNorm -> KDA (state in, state out) -> residual -> RMSNorm -> MLP or MoE -> residual."""

    def __init__(self, cfg: ModelConfig, hybrid: HybridConfig, sparse: bool) -> None:
        super().__init__()
        self.cfg, self.hybrid = cfg, hybrid
        hs, d, hd = cfg.hidden_size, hybrid.kda_dim, hybrid.kda_head_dim
        self.attn_norm, self.mlp_norm = _p(hs), _p(hs)
        self.wq, self.wk, self.wv = _p(d, hs), _p(d, hs), _p(d, hs)
        self.conv = _p(3 * d, hybrid.conv_kernel)  # q | k | v depthwise kernels
        self.a_log, self.dt_bias = _p(hybrid.kda_heads), _p(d)
        self.wf_a, self.wf_b = _p(hd, hs), _p(d, hd)  # forget gate (low rank)
        self.wb = _p(hybrid.kda_heads, hs)  # beta
        self.wg_a, self.wg_b = _p(hd, hs), _p(d, hd)  # output gate (low rank)
        self.o_norm = _p(hd)
        self.wo = _p(hs, d)
        if sparse:
            self.moe = MoE(cfg)
        else:
            self.w1, self.w3 = _p(cfg.intermediate_size, hs), _p(cfg.intermediate_size, hs)
            self.w2 = _p(hs, cfg.intermediate_size)

    ffn = MLALayer.ffn
    finish = MLALayer.finish

    def inputs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token projections of h [T, hidden]: (normalised x [T, hidden], q|k|v
        [T, 3D]) fp32 (batchable over requests)."""
        x = rms_norm(h, self.attn_norm, self.cfg.rms_eps)
        w = torch.cat([self.wq, self.wk, self.wv]).float()
        return x, x @ w.T

    def mix(self, x: torch.Tensor, qkv: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor,
            cuts: Sequence[int] = ()) -> tuple:
        """One request's tokens: x [T, hidden] (normalised), qkv [T, 3D], conv state [3D, K-1],
        recurrent state [H, Dk, Dv] -> (attention output [T, hidden] fp32, next conv state fp32,
        next recurrent state fp32, marks): ``marks[i]`` is the (conv, rec) state after the
        first ``cuts[i]`` tokens of the step (0 <= cut <= T; a state snapshot)."""
        hyb = self.hybrid
        t, h, dk = x.shape[0], hyb.kda_heads, hyb.kda_head_dim
        bounds = sorted({c for c in cuts if 0 < c < t}) + [t]
        ys, convs, start, cst = [], {0: conv.float()}, 0, conv
        for b in bounds:  # the convolution window at every cut
            y, cst = kda.short_conv(qkv[start:b], self.conv, cst)
            ys.append(y)
            convs[b], start = cst, b
        q, k, v = torch.cat(ys).view(t, 3, h, dk).unbind(1)
        q = kda.l2norm(q) * dk ** -0.5
        k = kda.l2norm(k)
        raw = ((x @ self.wf_a.float().T) @ self.wf_b.float().T).view(t, h, dk)
        g = kda.forget_gate(raw, self.a_log, self.dt_bias)
        beta = torch.sigmoid(x @ self.wb.float().T)  # [T, H]
        outs, recs, start, rst = [], {0: rec.float()}, 0, rec
        for b in bounds:  # the recurrent state at every cut
            part = slice(start, b)
            run = kda.kda_recurrent if b - start == 1 else kda.kda_chunked  # decode | prefill
            o, rst = run(q[part], k[part], v[part], g[part], beta[part], rst)
            outs.append(o)
            recs[b], start = rst, b
        gate = ((x @ self.wg_a.float().T) @ self.wg_b.float().T).view(t, h, dk)
        o = kda.gated_rms_norm(torch.cat(outs), self.o_norm, gate, self.cfg.rms_eps)
        marks = [(convs[c], recs[c]) for c in cuts]
        return o.reshape(t, h * dk) @ self.wo.float().T, cst, rst, marks


class KimiLinearModel(MLAModel):
    """Embedding, the layers in checkpoint order, final norm and LM head (``MLAModel``'s)."""

    def __init__(self, cfg: ModelConfig, hybrid: HybridConfig) -> None:
        nn.Module.__init__(self)
        if len(hybrid.mla_layers) != cfg.num_layers:
            raise ConfigError(f"ModelConfig.num_layers {cfg.num_layers} must be the number of "
                              f"full_attention layers ({len(hybrid.mla_layers)})")
        self.cfg, self.hybrid = cfg, hybrid
        self.source_digest: Optional[str] = None
        self.embed_tokens = _p(cfg.vocab_size, cfg.hidden_size)
        rotary = NoRotary()
        layers, kv_layer = [], []
        for i, (kind, mlp) in enumerate(zip(hybrid.layer_types, hybrid.mlp_layer_types)):
            sparse = mlp == "sparse"
            if kind == "full_attention":
                # MLALayer builds an MoE from moe.first_k_dense_replace (1) on: index 1 or 0
                layers.append(MLALayer(cfg, 1 if sparse else 0, rotary))
                kv_layer.append(sum(x is not None for x in kv_layer))
            else:
                layers.append(KDALayer(cfg, hybrid, sparse))
                kv_layer.append(None)
        self.layers = nn.ModuleList(layers)
        self.kv_layer: tuple = tuple(kv_layer)
        self.kda_index: tuple = tuple(hybrid.kda_layers.index(i) if k is None else None
                                      for i, k in enumerate(kv_layer))
        self.norm = _p(cfg.hidden_size)
        if not cfg.tie_word_embeddings:
            self.lm_head = _p(cfg.vocab_size, cfg.hidden_size)

    @torch.no_grad()
    def forward(self, tokens, attn_backend: str = "torch") -> torch.Tensor:
        """Dense single-process forward over the whole sequence: logits [T, vocab] fp32."""
        h = self.embed(tokens)
        pos = torch.arange(h.shape[0], dtype=torch.int64, device=h.device)
        cfg, hyb = self.cfg, self.hybrid
        for layer in self.layers:
            if isinstance(layer, KDALayer):
                x, qkv = layer.inputs(h)
                conv = torch.zeros(hyb.conv_state_shape(), device=h.device)
                rec = torch.zeros(hyb.rec_state_shape(), device=h.device)
                h = layer.finish(layer.mix(x, qkv, conv, rec)[0], h)
                continue
            rows = layer.kv_rows(h, pos)
            q_lat, q_pe = layer.query(h, pos)
            o, _ = attend_latent(q_lat, q_pe, rows, pos, pos, cfg.softmax_scale,
                                 cfg.kv_lora_rank, backend=attn_backend)
            h = layer.output(o, h)
        return self.logits(h)

    def weights_signature(self) -> str:
        return "kimi-linear-" + super().weights_signature()

    def save(self, path) -> None:
        raise UsageError("a Kimi Linear model is loaded from its checkpoint directory; "
                         "MLAModel.save files hold DeepSeek-shaped models only")
