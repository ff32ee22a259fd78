"""hicache: a hierarchical KV cache (device L1, host L2, LMDB L3) for MLA serving engines that
run decode context parallelism. ``HiCache`` is what one engine rank embeds."""

from .config import ConfigError, HiCacheConfig, load_config
from .service import MODES, HiCache, HiCacheError, Prefix

__all__ = ["ConfigError", "HiCache", "HiCacheConfig", "HiCacheError", "MODES", "Prefix",
           "load_config"]
__version__ = "0.1.0"
