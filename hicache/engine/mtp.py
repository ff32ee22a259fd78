"""DeepSeek-V3 multi-token-prediction (MTP) modules as a draft model.

A DeepSeek-V3-format checkpoint with ``num_nextn_predict_layers = n`` stores MTP module j
(0 <= j < n) at layer index ``num_hidden_layers + j``:

    model.layers.<N+j>.enorm.weight              [hidden]           RMSNorm of the embedding
    model.layers.<N+j>.hnorm.weight              [hidden]           RMSNorm of the hidden state
    model.layers.<N+j>.eh_proj.weight            [hidden, 2*hidden]
    model.layers.<N+j>.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}
                                                                    a full decoder layer (MLA;
                                                                    MoE or dense as config.json
                                                                    says for index N+j)
    model.layers.<N+j>.shared_head.norm.weight   [hidden]
    model.layers.<N+j>.embed_tokens.weight       [vocab, hidden]    optional (else the main one)
    model.layers.<N+j>.shared_head.head.weight   [vocab, hidden]    optional (else the main one)

One draft step at position i (the target's hidden state ``h_prev`` at i, the next token t):

    h = layer(eh_proj(cat(enorm(embed(t)), hnorm(h_prev))))
    logits = shared_head.head(shared_head.norm(h))

``MTPModule`` quacks like a one-layer ``MLAModel`` for ``DCPRunner`` (``cfg.num_layers == 1``,
``layers``, ``embed_tokens``, ``logits``); the runner is given the step's input rows
(``DCPRunner.extend_batch(..., inputs=mtp.inputs(tokens, h_prev))``). Its KV (one latent row
per position) is replicated: it runs on a ``DCPLayout(1, 0, P*c)`` pool on every DCP rank.
``load_mtp(dir, target)`` reads module j of a checkpoint; a missing tensor is a
``CheckpointError`` naming the first one missing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from hicache.engine.attention import attend_latent
from hicache.engine.model import MLALayer, MLAModel, ModelConfig, Rotary, rms_norm
from hicache.errors import CheckpointError, UsageError

__all__ = ["MTPModule", "load_mtp", "mtp_tensors", "num_mtp_modules"]

# the tensors every MTP module has, in the order they are checked (the first missing is named)
MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
MTP_OPTIONAL = ("embed_tokens.weight", "shared_head.head.weight")


def _p(shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class MTPModule(nn.Module):
    """MTP module ``index`` of a target model config (see the module doc)."""

    def __init__(self, target_cfg: ModelConfig, index: int = 0, *,
                 embed_tokens: Optional[torch.Tensor] = None,
                 head: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        hs, v = target_cfg.hidden_size, target_cfg.vocab_size
        self.index = index
        self.layer_index = target_cfg.num_layers + index
        self.cfg = dataclasses.replace(target_cfg, num_layers=1)  # what the runner sees
        self.enorm, self.hnorm, self.head_norm = _p((hs,)), _p((hs,)), _p((hs,))
        self.eh_proj = _p((hs, 2 * hs))
        self.layers = nn.ModuleList([MLALayer(target_cfg, self.layer_index,
                                              Rotary(target_cfg))])
        # shared with the main model when the checkpoint has no own copy (the same Parameter)
        self.embed_tokens = embed_tokens if embed_tokens is not None else _p((v, hs))
        self.head = head if head is not None else _p((v, hs))

    # ---- pieces ------------------------------------------------------------------------------
    def embed(self, tokens) -> torch.Tensor:
        tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.vocab_size):
            raise UsageError(f"token ids must be in [0, {self.cfg.vocab_size}); got range "
                             f"[{int(tokens.min())}, {int(tokens.max())}]")
        return self.embed_tokens[tokens.to(self.embed_tokens.device)].float()

    def inputs(self, tokens, h_prev: torch.Tensor) -> torch.Tensor:
        """The decoder layer's input [T, hidden] fp32: eh_proj(cat(enorm(e), hnorm(h_prev)))."""
        eps = self.cfg.rms_eps
        e = rms_norm(self.embed(tokens), self.enorm, eps)
        h = rms_norm(h_prev.float(), self.hnorm, eps)
        return torch.cat([e, h], -1) @ self.eh_proj.float().T

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.head_norm, self.cfg.rms_eps) @ self.head.float().T

    @torch.no_grad()
    def forward(self, tokens, h_prev: torch.Tensor) -> torch.Tensor:
        """Dense reference over positions 0..T-1 (causal): logits [T, vocab] fp32."""
        h = self.inputs(tokens, h_prev)
        pos = torch.arange(h.shape[0], dtype=torch.int64, device=h.device)
        layer, cfg = self.layers[0], self.cfg
        rows = layer.kv_rows(h, pos)
        q_lat, q_pe = layer.query(h, pos)
        o, _ = attend_latent(q_lat, q_pe, rows, pos, pos, cfg.softmax_scale, cfg.kv_lora_rank,
                             backend="torch")
        return self.logits(layer.output(o, h))

    def kv_bytes_per_token(self) -> int:
        return self.cfg.kv_bytes_per_token()


# ---- checkpoints -----------------------------------------------------------------------------
def num_mtp_modules(directory: str | Path) -> int:
    """``num_nextn_predict_layers`` of ``config.json`` (0 when absent)."""
    from hicache.engine.hf_config import load_json
    raw = load_json(Path(directory) / "config.json", "config.json")
    n = raw.get("num_nextn_predict_layers", 0) or 0
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise CheckpointError(f"{directory}: num_nextn_predict_layers must be an int >= 0, "
                              f"got {n!r}")
    return n


def mtp_tensors(cfg: ModelConfig, index: int = 0) -> dict[str, tuple[int, ...]]:
    """The required tensors of MTP module ``index`` -> shape, in checking order."""
    from hicache.engine.hf import expected_tensors
    hs, li = cfg.hidden_size, cfg.num_layers + index
    p = f"model.layers.{li}."
    out = {p + "enorm.weight": (hs,), p + "hnorm.weight": (hs,),
           p + "eh_proj.weight": (hs, 2 * hs), p + "shared_head.norm.weight": (hs,)}
    # the decoder layer: the main model's names and shapes at index N+j
    full = expected_tensors(dataclasses.replace(cfg, num_layers=li + 1))
    out.update({k: v for k, v in full.items() if k.startswith(p)})
    return out


def _engine_name(name: str, layer_index: int) -> str:
    """Checkpoint tensor name of the MTP module -> ``MTPModule`` parameter name."""
    from hicache.engine import hf
    p = f"model.layers.{layer_index}."
    rest = name[len(p):]
    fixed = {"enorm.weight": "enorm", "hnorm.weight": "hnorm", "eh_proj.weight": "eh_proj",
             "shared_head.norm.weight": "head_norm", "embed_tokens.weight": "embed_tokens",
             "shared_head.head.weight": "head"}
    if rest in fixed:
        return fixed[rest]
    return "layers.0." + hf._engine_name(name).split(".", 2)[2]  # layers.<i>.<x> -> layers.0.<x>


def load_mtp(directory: str | Path, target: MLAModel, index: int = 0) -> MTPModule:
    """MTP module ``index`` of the checkpoint ``directory`` whose main model is ``target``
    (its embedding and LM head are shared when the module has none of its own)."""
    from safetensors import safe_open
    from hicache.engine.hf_config import weight_files
    d = Path(directory)
    cfg = target.cfg
    n = num_mtp_modules(d)
    files, _ = weight_files(d)
    where = {}
    try:
        for f in files:
            st = safe_open(str(f), framework="pt", device="cpu")
            for k in st.keys():
                where[k] = st
    except Exception as e:  # a corrupt or foreign file
        raise CheckpointError(f"{d}: cannot read safetensors file: {e}") from None
    want = mtp_tensors(cfg, index)
    li = cfg.num_layers + index
    for k in want:
        if k not in where:
            raise CheckpointError(
                f"{d}: no MTP module {index}: tensor {k} is missing (config.json "
                f"num_nextn_predict_layers = {n}, num_hidden_layers = {cfg.num_layers})")
    opt = {f"model.layers.{li}.{k}": (cfg.vocab_size, cfg.hidden_size) for k in MTP_OPTIONAL}
    for k, shape in list(want.items()) + [(k, s) for k, s in opt.items() if k in where]:
        got = tuple(where[k].get_slice(k).get_shape())
        if got != shape:
            raise CheckpointError(f"{d}: tensor {k} has shape {list(got)}, config.json implies "
                                  f"{list(shape)}")
    dtype, h, dn = cfg.torch_dtype, cfg.num_heads, cfg.qk_nope_head_dim
    state = {}
    for k in list(want) + [k for k in opt if k in where]:
        t = where[k].get_tensor(k)
        if not t.is_floating_point():
            raise CheckpointError(f"{d}: tensor {k} has dtype {t.dtype}; expected a float")
        name = _engine_name(k, li)
        t = t.float() if (".moe.gate" in name or ".moe.e_bias" in name) else t.to(dtype)
        if k.endswith("kv_b_proj.weight"):
            per_head = t.view(h, -1, t.shape[-1])
            state[name.replace("kv_b_proj", "w_uk")] = per_head[:, :dn]
            state[name.replace("kv_b_proj", "w_uv")] = per_head[:, dn:]
        else:
            state[name] = t
    shared_embed = None if "embed_tokens" in state else target.embed_tokens
    shared_head = None if "head" in state else target.head
    with torch.device("meta"):
        mtp = MTPModule(cfg, index)
    if shared_embed is not None:
        mtp.embed_tokens = shared_embed
    if shared_head is not None:
        mtp.head = shared_head
    own = {k for k in mtp.state_dict() if k not in ("embed_tokens", "head")
           or k in state}
    if own != set(state):  # a mapping bug, not a user error
        raise CheckpointError(f"{d}: internal MTP name mapping mismatch: "
                              f"{sorted(own ^ set(state))[:5]}")
    mtp.load_state_dict(state, strict=False, assign=True)
    return mtp.to(target.embed_tokens.device)

