"""What the benchmark (``hicache.commands.bench``) and the fault soak
(``hicache.commands.soak``) both build: the engine's model and the policy's L3 backend. Neutral: it imports neither of them, so the
two never import each other for it (``tests/test_layering.py``)."""

from __future__ import annotations

from ..config import HiCacheConfig


def engine_model(cfg: HiCacheConfig, seed: int = 0):
    """The policy's checkpoint (``[model] path``) or the built-in seeded model."""
    if cfg.model.path:
        from ..checkpoints.hf import load_model
        return load_model(cfg.model.path)
    from ..engine.model import MLAModel
    from ..serving import model_config
    return MLAModel(model_config(cfg, seed=seed))


def l3_backend(cfg: HiCacheConfig):
    """The registered L3 backend the policy's ``l3.backend`` names."""
    from ..l3 import registry
    return registry.get(cfg.l3.backend)


__all__ = ["engine_model", "l3_backend"]
