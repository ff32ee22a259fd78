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
``hicache.checkpoints.mtp.load_mtp(dir, target)`` reads module j of a checkpoint; a missing
tensor is a ``CheckpointError`` naming the first one missing.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from hicache.engine.attention import attend_latent
from hicache.engine.model import MLALayer, ModelConfig, Rotary, rms_norm
from hicache.errors import UsageError

__all__ = ["MTPModule", "MTP_OPTIONAL", "MTP_OWN"]

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

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The decoder layer's output -> the module's final representation
        (``shared_head.norm``): what its head reads and, chained, its next step is fed."""
        return rms_norm(h, self.head_norm, self.cfg.rms_eps)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.head.float().T

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head_logits(self.final_norm(h))

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
