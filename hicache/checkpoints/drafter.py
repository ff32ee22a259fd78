"""The drafter a ``[spec]`` section asks for, built from checkpoints: the target's MTP module
(``hicache.checkpoints.mtp``) or a separate draft checkpoint of the same vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from hicache.checkpoints.hf import load_model
from hicache.checkpoints.mtp import load_mtp
from hicache.engine.spec import (DraftModelDrafter, Drafter, MTPDrafter, SpecSettings,
                                 replicated_runner)
from hicache.errors import CheckpointError, ConfigError, UsageError

__all__ = ["make_drafter"]


def make_drafter(settings: SpecSettings, target, target_path: Optional[str], page_tokens: int,
                 page_table: list, num_pages: int, attn_backend: str = "auto"
                 ) -> Optional[Drafter]:
    """The drafter ``settings`` asks for, on the target's device (None for method none).
    Bad input (no MTP tensors, another vocabulary) is a ``UsageError`` naming it."""
    if not settings.enabled:
        return None
    if settings.method == "mtp":
        if not target_path or not Path(target_path).is_dir():
            raise UsageError("spec method 'mtp' needs the target to be a checkpoint directory "
                             "with MTP tensors (--model DIR)")
        try:
            mtp = load_mtp(target_path, target)
        except (CheckpointError, ConfigError) as e:
            raise UsageError(f"--spec mtp: {e}") from None
        return MTPDrafter(replicated_runner(mtp, page_tokens, num_pages, attn_backend),
                          page_table)
    try:
        draft = load_model(settings.draft_model)
    except (CheckpointError, ConfigError) as e:
        raise UsageError(f"--draft-model: {e}") from None
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise UsageError(f"--draft-model {settings.draft_model}: vocabulary size "
                         f"{draft.cfg.vocab_size} differs from the target's "
                         f"{target.cfg.vocab_size}")
    draft = draft.to(target.embed_tokens.device)
    return DraftModelDrafter(replicated_runner(draft, page_tokens, num_pages, attn_backend),
                             page_table)
