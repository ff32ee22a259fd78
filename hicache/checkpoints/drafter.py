"""The drafter a ``[spec]`` section asks for, built from checkpoints: the target's MTP module
(``hicache.checkpoints.mtp``) or a separate draft checkpoint of the same vocabulary.

    draft = load_draft(settings, target, target_dir)        # the draft's weights
    cache = HiCache(cfg, ..., draft=draft_spec(draft, cfg.page_tokens))  # its pages cached too
    drafter = drafter_for(draft, page_table, cache.draft.kv)
or, without a cache, ``make_drafter(settings, target, target_dir, page_tokens, page_table,
num_pages)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from hicache.checkpoints.hf import load_model
from hicache.checkpoints.mtp import load_mtp
from hicache.engine.mtp import MTPModule
from hicache.engine.spec import (DraftModelDrafter, Drafter, MTPDrafter, SpecSettings,
                                 replicated_runner)
from hicache.errors import CheckpointError, ConfigError, UsageError

__all__ = ["make_drafter", "load_draft", "drafter_for", "draft_spec"]


def load_draft(settings: SpecSettings, target, target_path: Optional[str]):
    """The draft's module on the target's device: an ``MTPModule`` (method mtp) or an
    ``MLAModel`` (method draft); None for method none. Bad input is a ``UsageError``."""
    if not settings.enabled:
        return None
    if settings.method == "mtp":
        if not target_path or not Path(target_path).is_dir():
            raise UsageError("spec method 'mtp' needs the target to be a checkpoint directory "
                             "with MTP tensors (--model DIR)")
        try:
            return load_mtp(target_path, target)
        except (CheckpointError, ConfigError) as e:
            raise UsageError(f"--spec mtp: {e}") from None
    try:
        draft = load_model(settings.draft_model)
    except (CheckpointError, ConfigError) as e:
        raise UsageError(f"--draft-model: {e}") from None
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise UsageError(f"--draft-model {settings.draft_model}: vocabulary size "
                         f"{draft.cfg.vocab_size} differs from the target's "
                         f"{target.cfg.vocab_size}")
    return draft.to(target.embed_tokens.device)


def drafter_for(draft, page_tokens: int, page_table: list, num_pages: int,
                attn_backend: str = "auto", pool=None) -> Drafter:
    """A drafter of ``draft`` (from ``load_draft``) on a replicated runner (``pool``: the
    cache's draft pool, ``HiCache.draft.kv``, its checked port) sharing ``page_table`` with the target."""
    run = replicated_runner(draft, page_tokens, num_pages, attn_backend, pool)
    cls = MTPDrafter if isinstance(draft, MTPModule) else DraftModelDrafter
    return cls(run, page_table)


def draft_spec(draft, page_tokens: int):
    """The ``DraftSpec`` a ``HiCache`` keeps ``draft``'s pages under: its replicated format
    and a signature (an MTP module: its index, the target's weights sign the rest; a draft
    model: its weights)."""
    from hicache.companions.draft import DraftSpec
    from hicache.companions.draft_format import format_of_model
    mtp = isinstance(draft, MTPModule)
    sig = f"mtp:{draft.index}" if mtp else draft.weights_signature()
    # an MTP row pairs the target's state at i with token i + 1: a page's last row depends on
    # the token after the page, which its chain does not name (hicache.companions.draft)
    return DraftSpec(format_of_model(draft, page_tokens), sig, pairs_next=mtp)


def make_drafter(settings: SpecSettings, target, target_path: Optional[str], page_tokens: int,
                 page_table: list, num_pages: int, attn_backend: str = "auto", pool=None
                 ) -> Optional[Drafter]:
    """The drafter ``settings`` asks for, on the target's device (None for method none).
    ``pool``: the cache's draft pool (``HiCache.draft.kv``, its checked port), else a new one. Bad input (no
    MTP tensors, another vocabulary) is a ``UsageError`` naming it."""
    draft = load_draft(settings, target, target_path)
    if draft is None:
        return None
    return drafter_for(draft, page_tokens, page_table, num_pages, attn_backend, pool)
