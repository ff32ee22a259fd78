"""Seeded weights for the tiny Hugging Face checkpoints the tests write (DeepSeek-V3, Kimi
Linear, MTP): one recipe, so every checkpoint's logits are spread the same way."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def seed_weights(model, g: torch.Generator, *, skip: tuple[str, ...] = (),
                 embed_scale: float = 1.0) -> None:
    """Norms near 1, embeddings N(0, 1) * ``embed_scale``, every other matrix scaled by
    1/sqrt(fan-in) (the head x3 and MoE gates x4, so tokens and experts separate), MoE score
    biases N(0, 0.3); parameters whose name holds one of ``skip`` keep their values. Then
    ``model.eval()``."""
    for name, p in model.named_parameters():
        if any(s in name for s in skip):
            continue
        if "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif "embed" in name:
            p.copy_(torch.randn(p.shape, generator=g) * embed_scale)
        else:
            gain = 3.0 if "lm_head" in name else 4.0 if "gate.weight" in name else 1.0
            p.copy_(torch.randn(p.shape, generator=g) * gain / math.sqrt(p.shape[-1]))
    for name, b in model.named_buffers():
        if "e_score_correction_bias" in name:
            b.copy_(0.3 * torch.randn(b.shape, generator=g))
    model.eval()
