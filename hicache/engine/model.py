"""A tiny DeepSeek-style MLA transformer with seeded random weights.

Per layer: RMSNorm -> MLA attention (latent KV of ``kv_lora_rank`` plus a RoPE key part of
``qk_rope_head_dim``; query split into nope and rope parts, optionally through a q LoRA) ->
residual -> RMSNorm -> SwiGLU MLP -> residual. Embedding in, final RMSNorm and LM head out.

Attention is *absorbed*: q_nope goes through W_UK into the latent space, so the cache holds one
latent row per token (``c_kv | k_pe``) and the output stays latent until W_UV. The pieces a
caller needs to run attention itself (a DCP rank over its shard, a ring step):

    layer.kv_rows(h [T, hidden], positions [T]) -> rows [T, R + Dr]   (model dtype)
    layer.query(h, positions, heads=None) -> (q_lat [T, H', R], q_pe [T, H', Dr]) fp32
    layer.output(o_lat [T, H, R], h) -> h'                           (W_UV, o_proj, MLP)

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

from hicache.engine.attention import attend_latent

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelConfigError(ValueError):
    """A model configuration field is out of range or inconsistent."""


class ModelLoadError(ValueError):
    """A model file is missing, unreadable, or does not match its recorded config."""


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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "v_head_dim", "intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ModelConfigError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if (not isinstance(self.qk_rope_head_dim, int) or self.qk_rope_head_dim < 2
                or self.qk_rope_head_dim % 2):
            raise ModelConfigError(
                f"ModelConfig.qk_rope_head_dim must be an even int >= 2, got "
                f"{self.qk_rope_head_dim!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int)
                                             or self.q_lora_rank < 1):
            raise ModelConfigError(
                f"ModelConfig.q_lora_rank must be None or a positive int, got {self.q_lora_rank!r}")
        if self.dtype not in _DTYPES:
            raise ModelConfigError(
                f"ModelConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not self.rope_theta > 0:
            raise ModelConfigError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")

    @property
    def kv_dim(self) -> int:
        """Width of one latent cache row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)

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
            raise ModelConfigError(f"unknown ModelConfig fields: {unknown}")
        return cls(**d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on the last dim of x [T, ..., D] at int64 positions [T] (fp32 out)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]  # [T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d,)
    cos, sin = cos.view(shape), sin.view(shape)
    x = x.float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class MLALayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hs, h, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        e = lambda *s: nn.Parameter(torch.empty(*s), requires_grad=False)  # noqa: E731
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
        k_pe = rope(kv[:, cfg.kv_lora_rank:], positions, cfg.rope_theta)
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
        q_pe = rope(q[..., dn:], positions, cfg.rope_theta)
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

    def finish(self, attn: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Residual, then the MLP block: h' = h + attn; h' + MLP(norm(h'))."""
        h = h.float() + attn
        x = rms_norm(h, self.mlp_norm, self.cfg.rms_eps)
        g = torch.nn.functional.silu(x @ self.w1.float().T) * (x @ self.w3.float().T)
        return h + g @ self.w2.float().T

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
        self.layers = nn.ModuleList(MLALayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
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
        tokens = torch.as_tensor(tokens, dtype=torch.int64, device=self.embed_tokens.device)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {self.cfg.vocab_size}); got range "
                f"[{int(tokens.min())}, {int(tokens.max())}]")
        return self.embed_tokens[tokens].float()  # [T, hidden]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.norm, self.cfg.rms_eps) @ self.lm_head.float().T  # [T, vocab]

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
        """Read a file written by ``save``; every mismatch is a ModelLoadError."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ModelLoadError(f"model file not found: {path}")
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # corrupt or foreign file
            raise ModelLoadError(f"cannot read model file {path}: {exc}") from exc
        if not isinstance(blob, dict) or blob.get("format") != "hicache-mla-v1":
            raise ModelLoadError(f"{path} is not a hicache MLA model file")
        try:
            cfg = ModelConfig.from_dict(blob["config"])
        except (ModelConfigError, TypeError, KeyError) as exc:
            raise ModelLoadError(f"{path}: bad config: {exc}") from exc
        model = cls(cfg, init=False)
        state = blob.get("state", {})
        own = model.state_dict()
        missing = sorted(set(own) - set(state))
        extra = sorted(set(state) - set(own))
        if missing or extra:
            raise ModelLoadError(f"{path}: missing weights {missing}, unexpected {extra}")
        for k, v in own.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise ModelLoadError(
                    f"{path}: weight {k} has shape {tuple(state[k].shape)}, config says "
                    f"{tuple(v.shape)}")
        for k, p in model.named_parameters():
            p.data = state[k].to(cfg.torch_dtype)
        model.source_digest = file_digest(path)
        if device is not None:
            model.to(device)
        return model
