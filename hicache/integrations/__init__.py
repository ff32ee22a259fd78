"""Engine adapters: hicache's L3 page store behind the public extension points of vLLM
(:mod:`hicache.integrations.vllm`, a ``TieringOffloadingSpec`` secondary tier;
:mod:`hicache.integrations.vllm_cpu`, the same tiering on a CPU-only vLLM) and SGLang
(:mod:`hicache.integrations.sglang`, a HiCache ``dynamic`` storage backend). docs/integrations.md
has the configuration and the metric names.

Importing this package imports neither engine; each adapter module imports its engine.
"""
