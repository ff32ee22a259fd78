"""Engine adapters: hicache's L3 page store behind the public extension points of vLLM
(:mod:`hicache.integrations.vllm`, a ``TieringOffloadingSpec`` secondary tier) and SGLang
(:mod:`hicache.integrations.sglang`, a HiCache ``dynamic`` storage backend).

Importing this package imports neither engine; each adapter module imports its engine.
"""
