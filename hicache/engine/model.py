"""The engine's MLA transformer: the built-in seeded tiny model and DeepSeek-V2/V3 checkpoints.

Per layer: RMSNorm -> MLA attention (latent KV of ``kv_lora_rank`` plus a RoPE key part of
``qk_rope_head_dim``; query split into nope and rope parts, optionally through a q LoRA) ->
residual -> RMSNorm -> feed-forward -> residual. Embedding in, final RMSNorm and LM head out
(the LM head may be the embedding: ``tie_word_embeddings``). The feed-forward is a SwiGLU MLP,
or from layer ``moe.first_k_dense_replace`` on a mixture of experts (``MoE``: shared experts
plus routed experts chosen by grouped top-k). RoPE rotates halves (the built-in model) or
interleaved pairs (DeepSeek checkpoints), optionally YaRN-scaled (``YarnConfig``).

One ``ModelConfig`` describes both: the built-in model is ``MLAModel(ModelConfig(...))`` with
seeded random weights; ``hicache.checkpoints.hf.load_checkpoint(dir)`` builds the same class
from a Hugging Face checkpoint. Every caller (``DCPRunner.extend``, PCP prefill, the dense reference)
runs the same pieces.

Attention is *absorbed*: q_nope goes through W_UK into the latent space, so the cache holds one
latent row per token (``c_kv | k_pe``) and the output stays latent until W_UV. The pieces a
caller needs to run attention itself (a DCP rank over its shard, a ring step):

    layer.kv_rows(h [T, hidden], positions [T]) -> rows [T, R + Dr]   (model dtype)
    layer.query(h, positions, heads=None) -> (q_lat [T, H', R], q_pe [T, H', Dr]) fp32
    layer.output(o_lat [T, H, R], h) -> h'                           (W_UV, o_proj, FFN)

``MLAModel.forward(tokens)`` is the dense single-process reference. Compute is fp32; weights and
KV rows are stored in ``config.dtype``. ``weights_signature()`` names the weights for the L3 keys
(a digest of the file it was loaded from, else of the tensors).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from hicache.checks import check_int
from hicache.engine.attention import attend_latent
from hicache.errors import CheckpointError, ConfigError, UsageError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling (the fields a DeepSeek ``rope_scaling`` carries)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: Optional[float] = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor > 0 or not self.original_max_position_embeddings > 0:
            raise ConfigError(f"YarnConfig.factor and original_max_position_embeddings must "
                              f"be > 0, got {self.factor!r}, "
                              f"{self.original_max_position_embeddings!r}")

    def rope_factor(self) -> float:
        """Scale applied to the RoPE parts of q and k (cos and sin)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim)
        return _mscale(self.factor)

    def softmax_factor(self) -> float:
        """Correction of the softmax scale: mscale(factor, mscale_all_dim) squared."""
        m = _mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0
        return m * m

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        """float64 [dim/2]: extrapolated frequencies for fast dims, interpolated for slow ones,
        a linear ramp between (beta_fast and beta_slow rotations over the original context)."""
        def corr(rot: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rot * 2 * math.pi))
                    / (2 * math.log(theta)))
        low, high = corr(self.beta_fast), corr(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low)
                / (high - low)).clamp(0, 1)
        extra = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
        keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate
        return extra / self.factor * (1 - keep) + extra * keep


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts from layer ``first_k_dense_replace`` on (DeepSeek routing)."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "softmax"  # softmax | sigmoid (sigmoid adds e_score_correction_bias)
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "n_group", "topk_group"):
            check_int(getattr(self, name), f"MoEConfig.{name}", error=ConfigError)
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"MoEConfig.scoring_func must be softmax or sigmoid, got "
                              f"{self.scoring_func!r}")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ConfigError(f"MoEConfig.topk_method {self.topk_method!r} is unknown")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(f"MoEConfig: {self.n_routed_experts} experts do not split into "
                              f"n_group {self.n_group} with topk_group {self.topk_group}")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ConfigError("MoEConfig.num_experts_per_tok exceeds the experts of the "
                              "selected groups")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 8
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    q_lora_rank: Optional[int] = None
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    dtype: str = "float32"
    seed: int = 0
    rms_eps: float = 1e-6
    rope_interleave: bool = False  # rotate pairs (2i, 2i+1) (DeepSeek) instead of halves
    yarn: Optional[YarnConfig] = None  # a dict is accepted and converted
    moe: Optional[MoEConfig] = None  # a dict is accepted and converted
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "v_head_dim", "intermediate_size"):
            check_int(getattr(self, name), f"ModelConfig.{name}", error=ConfigError)
        if (not isinstance(self.qk_rope_head_dim, int) or self.qk_rope_head_dim < 2
                or self.qk_rope_head_dim % 2):
            raise ConfigError(
                f"ModelConfig.qk_rope_head_dim must be an even int >= 2, got "
                f"{self.qk_rope_head_dim!r}")
        if self.q_lora_rank is not None:
            check_int(self.q_lora_rank, "ModelConfig.q_lora_rank (None or an int)",
                      error=ConfigError)
        if self.dtype not in _DTYPES:
            raise ConfigError(
                f"ModelConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not self.rope_theta > 0:
            raise ConfigError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        for name, kind in (("yarn", YarnConfig), ("moe", MoEConfig)):
            v = getattr(self, name)
            if isinstance(v, dict):
                try:
                    object.__setattr__(self, name, kind(**v))
                except TypeError as e:
                    raise ConfigError(f"ModelConfig.{name}: {e}") from None
            elif v is not None and not isinstance(v, kind):
                raise ConfigError(f"ModelConfig.{name} must be a {kind.__name__}, a dict or "
                                  f"None, got {v!r}")

    @property
    def kv_dim(self) -> int:
        """Width of one latent cache row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def softmax_scale(self) -> float:
        base = 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)
        return base * (self.yarn.softmax_factor() if self.yarn else 1.0)

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i >= self.moe.first_k_dense_replace

    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token costs over all layers (one latent row per layer)."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.num_layers * self.kv_dim * elem

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields: {unknown}")
        return cls(**d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


class Rotary:
    """RoPE of one model: inverse frequencies (float64 [Dr/2]), pair layout, YaRN scale."""

    def __init__(self, cfg: ModelConfig) -> None:
        d = cfg.qk_rope_head_dim
        if cfg.yarn is not None:
            self.inv_freq = cfg.yarn.inv_freq(d, cfg.rope_theta)
            self.scale = cfg.yarn.rope_factor()
        else:
            self.inv_freq = 1.0 / (cfg.rope_theta ** (
                torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
            self.scale = 1.0
        self.interleave = cfg.rope_interleave
        self._on: dict = {}  # device -> inv_freq there (uploaded once, not per layer and step)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate the last dim of x [T, ..., D] at int64 positions [T] (fp32 out). Interleaved
        pairs come out as (rotated evens | rotated odds): the same for q and k, so the scores
        are those of the interleaved layout."""
        d = x.shape[-1]
        inv = self._on.get(x.device)
        if inv is None:
            inv = self._on[x.device] = self.inv_freq.to(x.device)
        ang = positions.to(torch.float64)[:, None] * inv[None, :]  # [T, D/2]
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
        cos, sin = ang.cos(), ang.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        cos, sin = cos.float().view(shape), sin.float().view(shape)
        x = x.float()
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def swiglu(x: torch.Tensor, w1, w3, w2) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)), fp32: x [T, hidden]; w1, w3 [I, hidden]; w2 [hidden, I]."""
    return (torch.nn.functional.silu(x @ w1.float().T) * (x @ w3.float().T)) @ w2.float().T


class Expert(nn.Module):
    """One SwiGLU expert: w1 (gate), w3 (up) [I, hidden], w2 (down) [hidden, I]."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = _param(inter, hidden), _param(inter, hidden), \
            _param(hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w1, self.w3, self.w2)


class MoE(nn.Module):
    """Shared experts plus the top-k routed experts of each token (a simple CPU loop)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.moe
        self.m = m
        hs = cfg.hidden_size
        self.gate = _param(m.n_routed_experts, hs)  # router [E, hidden]
        if m.scoring_func == "sigmoid":
            self.e_bias = _param(m.n_routed_experts)  # e_score_correction_bias [E]
        self.experts = nn.ModuleList(Expert(hs, m.moe_intermediate_size)
                                     for _ in range(m.n_routed_experts))
        self.shared = (Expert(hs, m.moe_intermediate_size * m.n_shared_experts)
                       if m.n_shared_experts else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] fp32 -> (weights fp32 [T, k], expert ids int64 [T, k])."""
        m = self.m
        logits = x @ self.gate.float().T  # [T, E]
        scores = logits.softmax(-1) if m.scoring_func == "softmax" else logits.sigmoid()
        choice = scores + self.e_bias.float() if m.scoring_func == "sigmoid" else scores
        if m.topk_method != "greedy":
            t, per = x.shape[0], m.n_routed_experts // m.n_group
            grouped = choice.view(t, m.n_group, per)
            if m.topk_method == "noaux_tc":  # a group scores its best two experts
                group_score = grouped.topk(2, dim=-1).values.sum(-1)
            else:  # group_limited_greedy: its best expert
                group_score = grouped.max(-1).values
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(m.topk_group, dim=-1).indices, True)
            fill = float("-inf") if m.topk_method == "noaux_tc" else 0.0
            choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), fill)
        idx = choice.topk(m.num_experts_per_tok, dim=-1).indices  # [T, k]
        w = scores.gather(1, idx)
        if m.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * m.routed_scaling_factor, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] fp32 -> [T, hidden] fp32."""
        w, idx = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        if self.shared is not None:
            out = out + self.shared(x)
        return out


class MLALayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0,
                 rotary: Optional[Rotary] = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = rotary or Rotary(cfg)
        hs, h, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        e = _param
        self.attn_norm = e(hs)
        if cfg.q_lora_rank:
            self.wq_a = e(cfg.q_lora_rank, hs)
            self.q_norm = e(cfg.q_lora_rank)
            self.wq_b = e(h * (dn + dr), cfg.q_lora_rank)
        else:
            self.wq = e(h * (dn + dr), hs)
        self.wkv_a = e(r + dr, hs)
        self.kv_norm = e(r)
        self.w_uk = e(h, dn, r)  # absorbed key up-projection
        self.w_uv = e(h, dv, r)  # value up-projection
        self.wo = e(hs, h * dv)
        self.mlp_norm = e(hs)
        if cfg.is_moe_layer(index):
            self.moe = MoE(cfg)
        else:
            self.w1 = e(cfg.intermediate_size, hs)
            self.w3 = e(cfg.intermediate_size, hs)
            self.w2 = e(hs, cfg.intermediate_size)

    # ---- pieces ------------------------------------------------------------------------------
    def kv_rows(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Latent cache rows [T, R + Dr] in the model dtype: normalised c_kv | roped k_pe."""
        cfg = self.cfg
        x = rms_norm(h, self.attn_norm, cfg.rms_eps)
        kv = x @ self.wkv_a.float().T  # [T, R + Dr]
        c = rms_norm(kv[:, : cfg.kv_lora_rank], self.kv_norm, cfg.rms_eps)
        k_pe = self.rotary(kv[:, cfg.kv_lora_rank:], positions)
        return torch.cat([c, k_pe], -1).to(cfg.torch_dtype)

    def query(self, h: torch.Tensor, positions: torch.Tensor,
              heads: Optional[slice] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed query for ``heads`` (default all): q_lat [T, H', R], q_pe [T, H', Dr] fp32."""
        cfg = self.cfg
        dn, dr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        heads = heads or slice(0, cfg.num_heads)
        n_h = len(range(cfg.num_heads)[heads])
        rows = slice(heads.start * (dn + dr), heads.stop * (dn + dr))
        x = rms_norm(h, self.attn_norm, cfg.rms_eps)
        if cfg.q_lora_rank:
            x = rms_norm(x @ self.wq_a.float().T, self.q_norm, cfg.rms_eps)
            q = x @ self.wq_b[rows].float().T
        else:
            q = x @ self.wq[rows].float().T
        q = q.view(-1, n_h, dn + dr)
        # [H', T, dn] @ [H', dn, R] -> [H', T, R] -> [T, H', R]
        q_lat = torch.bmm(q[..., :dn].transpose(0, 1), self.w_uk[heads].float()).transpose(0, 1)
        q_pe = self.rotary(q[..., dn:], positions)
        return q_lat, q_pe

    def attn_out(self, o_lat: torch.Tensor, heads: Optional[slice] = None) -> torch.Tensor:
        """o_proj contribution of ``heads`` (row-parallel): o_lat [T, H', R] -> [T, hidden]."""
        cfg = self.cfg
        heads = heads or slice(0, cfg.num_heads)
        dv = cfg.v_head_dim
        # [H', T, R] @ [H', R, dv] -> [H', T, dv] -> [T, H' * dv]
        v = torch.bmm(o_lat.float().transpose(0, 1), self.w_uv[heads].float().transpose(1, 2))
        cols = slice(heads.start * dv, heads.stop * dv)
        # explicit width: reshape(T, -1) cannot infer it when T == 0
        return v.transpose(0, 1).reshape(v.shape[1], v.shape[0] * dv) @ self.wo[:, cols].float().T

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward block on normalised x [T, hidden] fp32: SwiGLU MLP or MoE."""
        if hasattr(self, "moe"):
            return self.moe(x)
        return swiglu(x, self.w1, self.w3, self.w2)

    def finish(self, attn: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Residual, then the feed-forward block: h' = h + attn; h' + FFN(norm(h'))."""
        h = h.float() + attn
        return h + self.ffn(rms_norm(h, self.mlp_norm, self.cfg.rms_eps))

    def output(self, o_lat: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """All heads' latent output [T, H, R] and the layer input h -> the layer output."""
        return self.finish(self.attn_out(o_lat), h)


def file_digest(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """BLAKE2b-128 of a file's bytes, read in chunks (a weights file's identity)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tensors_digest(state: dict) -> str:
    """BLAKE2b-128 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class MLAModel(nn.Module):
    def __init__(self, cfg: ModelConfig, init: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.source_digest: Optional[str] = None  # set by ``load``: the file's digest
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size),
                                         requires_grad=False)
        rotary = Rotary(cfg)  # one table for every layer
        self.layers = nn.ModuleList(MLALayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size),
                                        requires_grad=False)
        if init:
            self._init_weights()

    def _init_weights(self) -> None:
        """Seeded random weights, scaled so activations and logits keep a useful spread."""
        g = torch.Generator().manual_seed(self.cfg.seed)
        for name, p in sorted(self.named_parameters()):
            if name.endswith("norm") or name == "norm":
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif name == "embed_tokens":
                val = torch.randn(p.shape, generator=g)
            else:
                fan_in = p.shape[-1]
                gain = 3.0 if name == "lm_head" else 1.0
                val = torch.randn(p.shape, generator=g) * (gain / math.sqrt(fan_in))
            p.data = val.to(self.cfg.torch_dtype)

    # ---- pieces ------------------------------------------------------------------------------
    def embed(self, tokens) -> torch.Tensor:
        """Token ids (host or device) -> [T, hidden] fp32. The ids are range-checked where they
        are: ids given on the host are checked there (numpy) before their upload, so an engine
        step that passes host ids never waits for the device here."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64)
        host = tokens.numpy() if tokens.device.type == "cpu" else tokens.cpu().numpy()
        if host.size and (host.min() < 0 or host.max() >= self.cfg.vocab_size):
            raise UsageError(
                f"token ids must be in [0, {self.cfg.vocab_size}); got range "
                f"[{int(host.min())}, {int(host.max())}]")
        # host ids: an async upload (a blocking one would wait for the device)
        ids = tokens.to(self.embed_tokens.device, non_blocking=True)
        return self.embed_tokens[ids].float()  # [T, hidden]

    @property
    def head(self) -> torch.Tensor:
        """The LM head [vocab, hidden] (the embedding when tied)."""
        return self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The last layer's output -> the model's final representation (its final RMSNorm):
        what the LM head reads, and what an MTP module is fed (``runner.last_hidden``)."""
        return rms_norm(h, self.norm, self.cfg.rms_eps)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final representation [T, hidden] -> logits [T, vocab] fp32."""
        return x @ self.head.float().T

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head_logits(self.final_norm(h))  # [T, vocab]

    # ---- dense reference ---------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, tokens, attn_backend: str = "torch") -> torch.Tensor:
        """Dense single-process forward over the whole sequence: logits [T, vocab] fp32."""
        h = self.embed(tokens)
        pos = torch.arange(h.shape[0], dtype=torch.int64, device=h.device)
        cfg = self.cfg
        for layer in self.layers:
            rows = layer.kv_rows(h, pos)
            q_lat, q_pe = layer.query(h, pos)
            o, _ = attend_latent(q_lat, q_pe, rows, pos, pos, cfg.softmax_scale,
                                 cfg.kv_lora_rank, backend=attn_backend)
            h = layer.output(o, h)
        return self.logits(h)

    @torch.no_grad()
    def generate(self, prompt, new_tokens: int) -> list[int]:
        """Greedy decode with the dense reference (recomputes every step): the new token ids."""
        seq = list(int(t) for t in prompt)
        out = []
        for _ in range(new_tokens):
            nxt = int(self.forward(seq)[-1].argmax())
            out.append(nxt)
            seq.append(nxt)
        return out

    def weights_signature(self) -> str:
        """The weights' identity for ``HiCache(weights_signature=...)``: the digest of the file
        the model was loaded from, else a digest of its tensors (seeded weights)."""
        if self.source_digest is not None:
            return f"mla-file:{self.source_digest}"
        return f"mla-weights:{tensors_digest(self.state_dict())}"

    # ---- files -------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write config and weights to one file (atomic rename)."""
        path = os.fspath(path)
        tmp = path + ".tmp"
        state = {k: v.detach().cpu().clone() for k, v in self.state_dict().items()}
        torch.save({"format": "hicache-mla-v1", "config": self.cfg.to_dict(), "state": state}, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device | None = None) -> "MLAModel":
        """Read a file written by ``save``; every mismatch is a CheckpointError."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise CheckpointError(f"model file not found: {path}")
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # corrupt or foreign file
            raise CheckpointError(f"cannot read model file {path}: {exc}") from exc
        if not isinstance(blob, dict) or blob.get("format") != "hicache-mla-v1":
            raise CheckpointError(f"{path} is not a hicache MLA model file")
        try:
            cfg = ModelConfig.from_dict(blob["config"])
        except (ConfigError, TypeError, KeyError) as exc:
            raise CheckpointError(f"{path}: bad config: {exc}") from exc
        model = cls(cfg, init=False)
        state = blob.get("state", {})
        own = model.state_dict()
        missing = sorted(set(own) - set(state))
        extra = sorted(set(state) - set(own))
        if missing or extra:
            raise CheckpointError(f"{path}: missing weights {missing}, unexpected {extra}")
        for k, v in own.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise CheckpointError(
                    f"{path}: weight {k} has shape {tuple(state[k].shape)}, config says "
                    f"{tuple(v.shape)}")
        for k, p in model.named_parameters():
            p.data = state[k].to(cfg.torch_dtype)
        model.source_digest = file_digest(path)
        if device is not None:
            model.to(device)
        return model
