"""The draft KV's page format: what a ``[spec]`` section adds to every logical page.

Speculative decoding keeps a draft's KV beside the target's (docs/speculative.md). The draft KV
is REPLICATED: every DCP rank holds all ``P*c`` rows of a page (``PageFormat.replicated``), so
its bytes per rank do not shrink with c. This module says how big it is, from the policy alone
(pure, but for reading a draft checkpoint's ``config.json`` or a saved model's header):

- ``method = "mtp"``: the target's first MTP module, one MLA layer of the target's latent
  width and dtype;
- ``method = "draft"``: every layer of the draft model (its ``config.json``, or the config in a
  file written by ``MLAModel.save``).

``HiCacheConfig.formats`` adds it as a companion of the target KV, so the pools, ``hicache
check-config``, the node memory check and the L2 page count all include the draft's bytes.
``plan_draft`` is the same arithmetic per token for ``hicache plan``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from hicache.errors import CheckpointError, ConfigError
from hicache.page_format import PageFormat

DRAFT_FORMAT = "draft"  # the companion format's name under a page id

__all__ = ["DRAFT_FORMAT", "DraftShape", "draft_shape", "draft_format", "format_of_model",
           "plan_draft"]


@dataclass(frozen=True)
class DraftShape:
    """The draft's KV per token: ``layers`` MLA layers of ``kv_dim`` elements of ``dtype``."""

    layers: int
    kv_dim: int
    dtype: str
    itemsize: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv_dim * self.itemsize


def _itemsize(dtype: str) -> int:
    import torch
    return getattr(torch, dtype).itemsize


def _saved_model_shape(path: str) -> DraftShape:
    import torch
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        c = blob["config"]
        layers, kv = int(c["num_layers"]), int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"])
        dtype = str(c.get("dtype", "float32")).removeprefix("torch.")
    except Exception as e:  # not a model file, or a foreign one
        raise ConfigError(f"spec.draft_model: cannot read the draft's shape from {path}: "
                          f"{type(e).__name__}: {e}") from None
    return DraftShape(layers, kv, dtype, _itemsize(dtype))


def draft_shape(cfg) -> Optional[DraftShape]:
    """The draft KV of ``cfg`` (a ``HiCacheConfig``) per token, None without ``[spec]``."""
    s, m = cfg.spec, cfg.model
    if s.method == "none":
        return None
    if s.method == "mtp":
        return DraftShape(1, m.kv_dim, m.dtype, _itemsize(m.dtype))
    path = s.draft_model
    if os.path.isdir(path):
        from hicache.checkpoints.hf_config import kv_shape
        try:
            k = kv_shape(path)
        except CheckpointError as e:
            raise ConfigError(f"spec.draft_model: {e}") from None
        return DraftShape(k["num_layers"], k["kv_lora_rank"] + k["rope_dim"], k["dtype"],
                          _itemsize(k["dtype"]))
    if os.path.isfile(path):
        return _saved_model_shape(path)
    raise ConfigError(f"spec.draft_model: {path!r} is neither a checkpoint directory nor a "
                      "model file")


def draft_format(cfg) -> Optional[PageFormat]:
    """The draft's companion ``PageFormat`` (replicated, ``P*c`` rows per page per rank)."""
    d = draft_shape(cfg)
    if d is None:
        return None
    return PageFormat.replicated(d.layers, cfg.cache.page_size, cfg.parallel.dcp, d.kv_dim,
                                 d.dtype, name=DRAFT_FORMAT)


def format_of_model(model, page_tokens: int) -> PageFormat:
    """The companion format of an engine draft (an ``MLAModel`` or ``MTPModule``) whose pages
    hold ``page_tokens`` (``P*c``) rows: what its replicated pool holds per page."""
    c = model.cfg
    return PageFormat(DRAFT_FORMAT, "replicated", c.num_layers, page_tokens, c.kv_dim,
                      c.torch_dtype)


def plan_draft(shape: DraftShape, memory: int, target_bytes_per_token_per_rank: int
               ) -> dict:
    """``hicache plan``: the draft's bytes per token on every rank (replicated: the same for
    any DCP size) and the tokens a rank's ``memory`` bytes hold with both (0: no budget)."""
    per_token = target_bytes_per_token_per_rank + shape.bytes_per_token
    return {"draft_kv_bytes_per_token_per_rank": shape.bytes_per_token,
            "kv_bytes_per_token_per_rank_with_draft": per_token,
            "tokens_in_budget_with_draft": int(memory // per_token) if memory else 0}
