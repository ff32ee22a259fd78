"""A Hugging Face Kimi Linear ``config.json`` -> the engine's model fields (no torch).

Kimi Linear (``KimiLinearForCausalLM``) interleaves two kinds of token mixer:

- ``full_attention`` layers: MLA as in DeepSeek-V2/V3 but without RoPE (the "rope" part of q
  and k is used unrotated), softmax scale ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``;
- ``linear_attention`` layers: Kimi Delta Attention (KDA, ``hicache.engine.kda``), whose state
  per request is a short-convolution window and an fp32 recurrent matrix per head.

``parse_kimi_config(raw) -> (mla_kwargs, hybrid)``: ``mla_kwargs`` are ``ModelConfig`` keyword
arguments describing the MLA part only (``num_layers`` = the number of ``full_attention`` layers,
which is what the KV cache holds), ``hybrid`` the ``HybridConfig`` keyword arguments (layer kinds,
MLP kinds, KDA shape). Layer kinds come from ``layer_types`` or else from
``linear_attn_config.kda_layers`` / ``full_attn_layers`` (1-indexed, as published); the MLP kind
of each layer from ``mlp_layer_types`` or ``first_k_dense_replace`` (default 1). Routing is
transformers' ``KimiLinearTopkRouter``: sigmoid scores plus ``e_score_correction_bias`` for the
choice, groups scored by their best two, weights renormalised when ``moe_renormalize``, times
``routed_scaling_factor``; shared experts always present. Every value the engine does not run
is a ``CheckpointError`` naming the key.
"""

from __future__ import annotations

from hicache.checks import check_int
from hicache.errors import CheckpointError

ARCHITECTURE = "KimiLinearForCausalLM"
LAYER_KINDS = ("full_attention", "linear_attention")
MLP_KINDS = ("dense", "sparse")
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}

# transformers' KimiLinearConfig defaults, under the keys config.json may use (first wins)
_ALIASES = {
    "n_routed_experts": ("num_experts", "n_routed_experts", "num_local_experts"),
    "num_experts_per_tok": ("num_experts_per_token", "num_experts_per_tok"),
    "n_shared_experts": ("num_shared_experts", "n_shared_experts"),
    "n_group": ("num_expert_group", "n_group"),
    "norm_topk_prob": ("moe_renormalize", "norm_topk_prob"),
}
_DEFAULTS = dict(vocab_size=163840, hidden_size=2304, intermediate_size=9216,
                 moe_intermediate_size=1024, num_hidden_layers=27, num_attention_heads=32,
                 kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
                 qk_nope_head_dim=128, routed_scaling_factor=2.446, rms_norm_eps=1e-5,
                 n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=1,
                 topk_group=1, norm_topk_prob=True, hidden_act="silu", attention_bias=False,
                 tie_word_embeddings=False)
_LINEAR_DEFAULTS = {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4}
_LINEAR_TOP = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
               "short_conv_kernel_size": "linear_conv_kernel_dim"}


def is_kimi(raw: dict) -> bool:
    archs = raw.get("architectures")
    return isinstance(archs, list) and archs == [ARCHITECTURE]


def _get(raw: dict, key: str):
    for k in _ALIASES.get(key, (key,)):
        if raw.get(k) is not None:
            return raw[k]
    return _DEFAULTS.get(key)


def _int(raw: dict, key: str, src: str, lo: int = 1) -> int:
    return check_int(_get(raw, key), f"{src}: {key}", lo, error=CheckpointError)


def _layer_types(raw: dict, layers: int, lin: dict, src: str) -> tuple[str, ...]:
    """Every layer's kind: ``layer_types``, else the 1-indexed lists of ``linear_attn_config``."""
    given = raw.get("layer_types")
    lists = "kda_layers" in lin and "full_attn_layers" in lin
    from_lists = None
    if lists:
        kinds: list = [None] * layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers",
                                                                    "linear_attention")):
            ids = lin[key]
            if not isinstance(ids, list):
                raise CheckpointError(f"{src}: linear_attn_config.{key} must be a list of layer "
                                      f"numbers, got {ids!r:.60}")
            for n in ids:
                if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= layers:
                    raise CheckpointError(f"{src}: linear_attn_config.{key} holds {n!r}; layer "
                                          f"numbers are 1-indexed in [1, {layers}]")
                if kinds[n - 1] is not None:
                    raise CheckpointError(f"{src}: layer {n} is listed twice in "
                                          "linear_attn_config (kda_layers / full_attn_layers)")
                kinds[n - 1] = kind
        if None in kinds:
            raise CheckpointError(f"{src}: linear_attn_config lists no kind for layer "
                                  f"{kinds.index(None) + 1} (1-indexed) of {layers}")
        from_lists = tuple(kinds)
    if given is None:
        if from_lists is not None:
            return from_lists
        # transformers' default: every 4th layer (not the first) is full attention
        return tuple("full_attention" if i and i % 4 == 0 else "linear_attention"
                     for i in range(layers))
    if not isinstance(given, list) or len(given) != layers:
        raise CheckpointError(f"{src}: layer_types must list {layers} layer kinds "
                              f"(num_hidden_layers), got {given!r:.80}")
    for i, kind in enumerate(given):
        if kind not in LAYER_KINDS:
            raise CheckpointError(f"{src}: layer_types[{i}] {kind!r} is not a known layer type; "
                                  f"expected {' or '.join(map(repr, LAYER_KINDS))}")
    if from_lists is not None and tuple(given) != from_lists:
        i = next(j for j in range(layers) if given[j] != from_lists[j])
        raise CheckpointError(f"{src}: layer_types[{i}] is {given[i]!r} but "
                              f"linear_attn_config lists layer {i + 1} as {from_lists[i]!r}")
    return tuple(given)


def _mlp_types(raw: dict, layers: int, src: str) -> tuple[str, ...]:
    given = raw.get("mlp_layer_types")
    if given is None:
        first = raw.get("first_k_dense_replace", 1)
        first = check_int(first, f"{src}: first_k_dense_replace", 0, error=CheckpointError)
        return tuple("dense" if i < first else "sparse" for i in range(layers))
    if not isinstance(given, list) or len(given) != layers:
        raise CheckpointError(f"{src}: mlp_layer_types must list {layers} kinds "
                              f"(num_hidden_layers), got {given!r:.80}")
    for i, kind in enumerate(given):
        if kind not in MLP_KINDS:
            raise CheckpointError(f"{src}: mlp_layer_types[{i}] {kind!r} is not a known MLP "
                                  f"type; expected 'dense' or 'sparse'")
    return tuple(given)


def _moe(raw: dict, src: str) -> dict:
    act = raw.get("moe_router_activation_func", "sigmoid")
    if act != "sigmoid":
        raise CheckpointError(f"{src}: moe_router_activation_func {act!r} is not supported "
                              "(only 'sigmoid')")
    if raw.get("moe_layer_freq", 1) != 1:
        raise CheckpointError(f"{src}: moe_layer_freq {raw['moe_layer_freq']!r} is not "
                              "supported (only 1; give mlp_layer_types instead)")
    experts = _int(raw, "n_routed_experts", src)
    groups = _int(raw, "n_group", src)
    top_k = _int(raw, "num_experts_per_tok", src)
    topk_group = _int(raw, "topk_group", src)
    if experts % groups:
        raise CheckpointError(f"{src}: num_experts {experts} is not a multiple of "
                              f"num_expert_group {groups}")
    if experts // groups < 2:
        raise CheckpointError(f"{src}: the router scores a group by its best two experts; "
                              f"num_experts / num_expert_group = {experts // groups}")
    if topk_group > groups or top_k > topk_group * (experts // groups):
        raise CheckpointError(f"{src}: num_experts_per_token {top_k} with topk_group "
                              f"{topk_group} does not fit {groups} groups of "
                              f"{experts // groups} experts")
    scale = _get(raw, "routed_scaling_factor")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise CheckpointError(f"{src}: routed_scaling_factor must be a number, got {scale!r}")
    norm = _get(raw, "norm_topk_prob")
    if not isinstance(norm, bool):
        raise CheckpointError(f"{src}: moe_renormalize must be true or false, got {norm!r}")
    shared = check_int(_get(raw, "n_shared_experts"), f"{src}: num_shared_experts", 0,
                       error=CheckpointError)
    return {"n_routed_experts": experts, "num_experts_per_tok": top_k,
            "n_shared_experts": shared,
            "moe_intermediate_size": _int(raw, "moe_intermediate_size", src),
            "first_k_dense_replace": 1,  # MLALayer(index 0) is dense, (index 1) MoE
            "n_group": groups, "topk_group": topk_group, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc", "norm_topk_prob": norm,
            "routed_scaling_factor": float(scale)}


def parse_kimi_config(raw: dict, src: str = "config.json",
                      weight_dtype: str | None = None) -> tuple[dict, dict]:
    """``config.json`` contents -> (``ModelConfig`` kwargs of the MLA part, ``HybridConfig``
    kwargs). See the module doc."""
    _check_supported(raw, src)
    layers = _int(raw, "num_hidden_layers", src)
    heads = _int(raw, "num_attention_heads", src)
    if raw.get("num_key_value_heads") not in (None, heads):
        raise CheckpointError(f"{src}: num_key_value_heads {raw['num_key_value_heads']!r} is "
                              f"not supported; MLA needs it equal to num_attention_heads "
                              f"({heads})")
    lin, shape = _linear_shape(raw, src)
    kinds = _layer_types(raw, layers, lin, src)
    mlps = _mlp_types(raw, layers, src)
    mla_layers = sum(k == "full_attention" for k in kinds)
    if not mla_layers:
        raise CheckpointError(f"{src}: no full_attention layer; the engine needs at least one "
                              "MLA layer (its KV is what the cache holds)")
    name = _dtype_name(raw, src, weight_dtype)
    mla = _mla_kwargs(raw, src, heads, mla_layers, name, "sparse" in mlps)
    hybrid = {"layer_types": kinds, "mlp_layer_types": mlps, "kda_heads": shape["num_heads"],
              "kda_head_dim": shape["head_dim"],
              "conv_kernel": shape["short_conv_kernel_size"]}
    return mla, hybrid


def _check_supported(raw: dict, src: str) -> None:
    """CheckpointError for a config that is not Kimi Linear or uses a feature the engine does
    not run (quantization, another activation, attention bias, RoPE or an output gate in MLA)."""
    if not is_kimi(raw):
        raise CheckpointError(f"{src}: architectures {raw.get('architectures')!r} is not "
                              f"[{ARCHITECTURE!r}]")
    if raw.get("quantization_config") is not None:
        raise CheckpointError(f"{src}: quantization_config is not supported; dequantize the "
                              "checkpoint to bf16 or fp32 first")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False)):
        if _get(raw, key) != want:
            raise CheckpointError(f"{src}: {key} {_get(raw, key)!r} is not supported (only "
                                  f"{want!r})")
    if raw.get("mla_use_nope", True) is not True:
        raise CheckpointError(f"{src}: mla_use_nope {raw['mla_use_nope']!r} is not supported "
                              "(Kimi Linear's MLA layers run without RoPE)")
    if raw.get("mla_use_output_gate"):
        raise CheckpointError(f"{src}: mla_use_output_gate is not supported")


def _linear_shape(raw: dict, src: str) -> tuple[dict, dict]:
    """(``linear_attn_config``, the KDA layers' integer shape fields with their defaults)."""
    lin = raw.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise CheckpointError(f"{src}: linear_attn_config must be an object, got {lin!r:.60}")
    for key in ("gate_lower_bound", "use_full_rank_gate"):
        if lin.get(key):
            raise CheckpointError(f"{src}: linear_attn_config.{key} {lin[key]!r} is not "
                                  "supported")
    shape = {}
    for key, default in _LINEAR_DEFAULTS.items():
        v = lin.get(key, raw.get(_LINEAR_TOP[key], default))
        shape[key] = check_int(v, f"{src}: linear_attn_config.{key}", error=CheckpointError)
    return lin, shape


def _dtype_name(raw: dict, src: str, weight_dtype: str | None) -> str:
    """The weights' dtype name (a key of ``_DTYPES``): the config's, else the files'."""
    name = raw.get("dtype") or raw.get("torch_dtype") or weight_dtype or "float32"
    if isinstance(name, str):
        name = name.removeprefix("torch.")
    name = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(name, name)
    if name not in _DTYPES:
        raise CheckpointError(f"{src}: dtype {name!r} is not supported; expected float32, "
                              "bfloat16 or float16")
    return name


def _mla_kwargs(raw: dict, src: str, heads: int, mla_layers: int, dtype_name: str,
                moe: bool) -> dict:
    """``ModelConfig`` kwargs of the MLA part (``moe``: some layer has a sparse MLP)."""
    eps = _get(raw, "rms_norm_eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise CheckpointError(f"{src}: rms_norm_eps must be a positive number, got {eps!r}")
    rope_dim = _int(raw, "qk_rope_head_dim", src, lo=2)
    if rope_dim % 2:
        raise CheckpointError(f"{src}: qk_rope_head_dim must be even, got {rope_dim}")
    q_lora = raw.get("q_lora_rank")
    return {
        "vocab_size": _int(raw, "vocab_size", src),
        "hidden_size": _int(raw, "hidden_size", src),
        "num_layers": mla_layers,
        "num_heads": heads,
        "kv_lora_rank": _int(raw, "kv_lora_rank", src),
        "qk_nope_head_dim": _int(raw, "qk_nope_head_dim", src),
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": _int(raw, "v_head_dim", src),
        "q_lora_rank": None if q_lora is None else _int(raw, "q_lora_rank", src),
        "intermediate_size": _int(raw, "intermediate_size", src),
        "dtype": _DTYPES[dtype_name],
        "rms_eps": float(eps),
        "moe": _moe(raw, src) if moe else None,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings")),
    }
