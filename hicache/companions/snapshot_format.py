"""Sizes of a hybrid checkpoint's KDA state snapshots, from the policy file (pure, no I/O beyond
reading the checkpoint's ``config.json``; neutral: the service, the preflight checks, the plan
and the bench read them here).

A snapshot is the STATE ``PageFormat`` of the page that ends at its position: every KDA layer's
short-convolution window and recurrent matrix, kept as fp32 (``row_width`` = conv + recurrent
elements per layer; a bf16 window widens exactly, so a restore gives the same bits back).
"""

from __future__ import annotations

import functools

from hicache.errors import CheckpointError, ConfigError


@functools.lru_cache(maxsize=16)
def _shape(path: str) -> tuple[int, int, int] | None:
    from hicache.checkpoints.hf_config import state_shape
    try:
        return state_shape(path)
    except CheckpointError as e:
        raise ConfigError(f"model.path: {e}") from None


def state_format(cfg):
    """The snapshot's ``PageFormat`` (STATE, replicated) of ``cfg``'s checkpoint, or None when
    ``model.path`` is not a hybrid checkpoint. ConfigError when ``hybrid.l1_state_bytes`` holds
    no snapshot."""
    if not cfg.model.path:
        return None
    shape = _shape(cfg.model.path)
    if shape is None:
        return None
    from hicache.page_format import PageFormat
    layers, conv, rec = shape
    fmt = PageFormat.state(layers, conv + rec, "float32", name="kda_state")
    if cfg.hybrid.l1_state_bytes < fmt.page_bytes:
        raise ConfigError(f"hybrid.l1_state_bytes: {cfg.hybrid.l1_state_bytes} bytes hold no "
                          f"KDA state snapshot of this checkpoint ({fmt.page_bytes} bytes)")
    return fmt


def conv_elems(cfg) -> int:
    """Short-convolution elements per KDA layer of ``cfg``'s hybrid checkpoint (the split of a
    snapshot's flat row: conv first, then the recurrent matrix)."""
    return _shape(cfg.model.path)[1]


def snapshot_slots(cfg, l2: bool) -> tuple[int, int]:
    """(L1 snapshots, L2 snapshots) per rank ``cfg`` holds; (0, 0) without a hybrid model."""
    fmt = state_format(cfg)
    if fmt is None:
        return 0, 0
    l1 = cfg.hybrid.l1_state_bytes // fmt.page_bytes
    return l1, int(l1 * cfg.l2.ratio) if l2 else 0


def state_bytes(cfg, l2: bool) -> tuple[int, int]:
    """(L1, L2) bytes per rank of the snapshot pools (``snapshot_slots`` times a snapshot)."""
    fmt = state_format(cfg)
    if fmt is None:
        return 0, 0
    l1, h = snapshot_slots(cfg, l2)
    return l1 * fmt.page_bytes, h * fmt.page_bytes
