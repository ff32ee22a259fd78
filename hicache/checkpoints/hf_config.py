"""A Hugging Face DeepSeek-V2/V3-family ``config.json`` -> the engine's model fields (no torch).

``read_hf_config(dir) -> dict`` returns ``ModelConfig`` keyword arguments (see
``hicache.engine.model``): shapes, RMSNorm eps, RoPE (theta, interleaved pairs, YaRN), the MoE
routing and tied embeddings. It accepts what published checkpoints write (``rope_scaling`` with
``type``, ``rope_theta`` at the top level, ``torch_dtype``) and what transformers 5 writes
(``rope_parameters`` with ``rope_type`` and ``rope_theta``, ``dtype``). Every value the engine
does not implement is a ``CheckpointError`` naming the key, raised before any weight is read.

Semantics follow transformers' ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``, which the
tests check token for token:
- V2: softmax router scores; ``topk_method`` greedy or group_limited_greedy (a group scores its
  best expert); weights times ``routed_scaling_factor``, never renormalised (``norm_topk_prob``
  must be false: transformers and DeepSeek's own V2 code disagree on it); interleaved RoPE pairs.
- V3 (also Kimi K2 and kin): sigmoid scores plus ``e_score_correction_bias`` for the choice only;
  a group scores the sum of its best two; weights renormalised when ``norm_topk_prob``, then
  times ``routed_scaling_factor``; ``rope_interleave`` as configured.
- Layers ``>= first_k_dense_replace`` are MoE (``moe_layer_freq`` 1), the others dense SwiGLU.
- RoPE fields are read where transformers 5 reads them (``original_max_position_embeddings`` at
  the top level first, then in the RoPE dict; ``rope_theta`` and ``partial_rotary_factor`` in
  the dict first, then at the top level).
- YaRN: interpolated inverse frequencies, the RoPE part of q and k scaled by
  ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (or ``attention_factor``) and the
  softmax scale by ``mscale(factor, mscale_all_dim) ** 2``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hicache.checks import check_int, regular_file
from hicache.checkpoints.kimi_config import is_kimi, parse_kimi_config
from hicache.errors import CheckpointError

ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


# transformers' defaults for keys a config.json may leave out
_COMMON = dict(num_key_value_heads=None, hidden_act="silu", rms_norm_eps=1e-6,
               tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
               quantization_config=None, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=1536,
               qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128)
_DEFAULTS = {
    "deepseek_v2": dict(_COMMON, vocab_size=102400, hidden_size=4096, intermediate_size=11008,
                        num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048,
                        first_k_dense_replace=0, n_group=None, n_routed_experts=64,
                        n_shared_experts=2, routed_scaling_factor=1.0, topk_group=None,
                        topk_method="greedy", norm_topk_prob=False, num_experts_per_tok=None,
                        moe_intermediate_size=1407, scoring_func="softmax", rope_interleave=True),
    "deepseek_v3": dict(_COMMON, vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
                        n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                        norm_topk_prob=True, max_position_embeddings=4096, rope_interleave=True,
                        topk_method="noaux_tc", scoring_func="sigmoid"),
}
_ROUTING = {  # architecture -> (scoring_func, allowed topk_method values)
    "deepseek_v2": ("softmax", ("greedy", "group_limited_greedy")),
    "deepseek_v3": ("sigmoid", ("noaux_tc",)),
}


def load_json(path: Path, what: str) -> dict:
    regular_file(path, what, CheckpointError)  # stat before open: a FIFO would hang the read
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: no {path.name} (not a Hugging Face checkpoint "
                              "directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read {what}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object")
    return data


def architecture(raw: dict, src: str) -> str:
    """``deepseek_v2`` or ``deepseek_v3`` from ``architectures`` (an unknown one is an error)."""
    archs = raw.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        known = [*ARCHITECTURES, "KimiLinearForCausalLM"]
        raise CheckpointError(f"{src}: architectures {archs!r} is not supported; expected "
                              f"[{' or '.join(repr(a) for a in known)}]")
    return ARCHITECTURES[archs[0]]


def _rope(raw: dict, arch: str, src: str) -> tuple[float, dict | None]:
    """(rope_theta, YaRN fields or None) from ``rope_scaling`` or ``rope_parameters``."""
    params = raw.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = raw.get("rope_scaling"), "rope_scaling"
    if params is not None and not isinstance(params, dict):
        raise CheckpointError(f"{src}: {key} must be an object, got {params!r}")
    params = dict(params or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise CheckpointError(f"{src}: rope_theta must be a positive number, got {theta!r}")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    # where transformers reads each field: rope_theta and partial_rotary_factor from the RoPE
    # dict first, then the top level; original_max_position_embeddings from the TOP LEVEL first
    # (``standardize_rope_params``), then the dict, then max_position_embeddings
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise CheckpointError(f"{src}: partial_rotary_factor {partial!r} is not supported "
                              "(only 1.0)")
    if kind == "default":
        return float(theta), None
    if kind != "yarn":
        raise CheckpointError(f"{src}: {key} type {kind!r} is not supported; expected "
                              "'default' or 'yarn'")
    max_pos = raw.get("max_position_embeddings", _DEFAULTS[arch]["max_position_embeddings"])
    orig = (raw.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings") or max_pos)
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / orig
    yarn = {
        "factor": float(factor),
        "original_max_position_embeddings": int(orig),
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "mscale": float(params.get("mscale") or 0.0),
        "mscale_all_dim": float(params.get("mscale_all_dim") or 0.0),
        "attention_factor": (None if params.get("attention_factor") is None
                             else float(params["attention_factor"])),
        "truncate": bool(params.get("truncate", True)),
    }
    if not yarn["factor"] > 0 or not yarn["original_max_position_embeddings"] > 0:
        raise CheckpointError(f"{src}: {key}.factor and original_max_position_embeddings must be "
                              f"> 0, got {factor!r} and {orig!r}")
    return float(theta), yarn


def _int(cfg: dict, name: str, src: str, lo: int = 1, optional: bool = False) -> int | None:
    v = cfg.get(name)
    if v is None and optional:
        return None
    return check_int(v, f"{src}: {name}", lo, error=CheckpointError)


def parse_config(raw: dict, src: str = "config.json", weight_dtype: str | None = None) -> dict:
    """``config.json`` contents -> ``ModelConfig`` keyword arguments (see the module doc).

    ``weight_dtype`` (the dtype of the stored weights) is used when the file names none.
    """
    arch = architecture(raw, src)
    if raw.get("quantization_config") is not None:
        q = raw["quantization_config"]
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise CheckpointError(f"{src}: quantization_config ({method!r}) is not supported; "
                              "dequantize the checkpoint to bf16 or fp32 first")
    cfg = dict(_DEFAULTS[arch])
    cfg.update({k: v for k, v in raw.items() if v is not None or k in ("q_lora_rank",)})
    for name, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if cfg.get(name) != want:
            raise CheckpointError(f"{src}: {name} {cfg.get(name)!r} is not supported (only "
                                  f"{want!r})")
    heads = _int(cfg, "num_attention_heads", src)
    if cfg.get("num_key_value_heads") not in (None, heads):
        raise CheckpointError(f"{src}: num_key_value_heads {cfg['num_key_value_heads']!r} is not "
                              f"supported; MLA needs it equal to num_attention_heads ({heads})")
    layers = _int(cfg, "num_hidden_layers", src)
    rope_dim = _int(cfg, "qk_rope_head_dim", src, lo=2)
    if rope_dim % 2:
        raise CheckpointError(f"{src}: qk_rope_head_dim must be even, got {rope_dim}")
    name = raw.get("dtype") or raw.get("torch_dtype") or weight_dtype or "float32"
    if isinstance(name, str):
        name = name.removeprefix("torch.")
    if name not in DTYPES:
        raise CheckpointError(f"{src}: dtype {name!r} is not supported; expected float32, "
                              "bfloat16 or float16")
    eps = cfg.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise CheckpointError(f"{src}: rms_norm_eps must be a positive number, got {eps!r}")
    theta, yarn = _rope(raw, arch, src)
    interleave = cfg.get("rope_interleave") if arch == "deepseek_v3" else True
    if not isinstance(interleave, bool):
        raise CheckpointError(f"{src}: rope_interleave must be true or false, got {interleave!r}")
    first_dense = _int(cfg, "first_k_dense_replace", src, lo=0)
    out = {
        "vocab_size": _int(cfg, "vocab_size", src),
        "hidden_size": _int(cfg, "hidden_size", src),
        "num_layers": layers,
        "num_heads": heads,
        "kv_lora_rank": _int(cfg, "kv_lora_rank", src),
        "qk_nope_head_dim": _int(cfg, "qk_nope_head_dim", src),
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": _int(cfg, "v_head_dim", src),
        "q_lora_rank": _int(cfg, "q_lora_rank", src, optional=True),
        "intermediate_size": _int(cfg, "intermediate_size", src),
        "rope_theta": theta,
        "dtype": DTYPES[name],
        "rms_eps": float(eps),
        "rope_interleave": interleave,
        "yarn": yarn,
        "moe": _moe(cfg, arch, first_dense, layers, src),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings")),
    }
    return out


def _moe(cfg: dict, arch: str, first_dense: int, layers: int, src: str) -> dict | None:
    if first_dense >= layers:
        return None  # every layer is dense
    if cfg.get("moe_layer_freq", 1) != 1:
        raise CheckpointError(f"{src}: moe_layer_freq {cfg['moe_layer_freq']!r} is not supported "
                              "(only 1: every layer from first_k_dense_replace on is MoE)")
    scoring, methods = _ROUTING[arch]
    if cfg.get("scoring_func", scoring) != scoring:
        raise CheckpointError(f"{src}: scoring_func {cfg['scoring_func']!r} is not supported for "
                              f"{arch} (only {scoring!r})")
    method = cfg.get("topk_method")
    if method not in methods:
        raise CheckpointError(f"{src}: topk_method {method!r} is not supported for {arch}; "
                              f"expected one of {', '.join(map(repr, methods))}")
    norm = cfg.get("norm_topk_prob")
    if arch == "deepseek_v2" and norm:
        raise CheckpointError(f"{src}: norm_topk_prob true is not supported for deepseek_v2 "
                              "(transformers ignores it, DeepSeek's code renormalises)")
    experts = _int(cfg, "n_routed_experts", src)
    top_k = _int(cfg, "num_experts_per_tok", src)
    shared = _int(cfg, "n_shared_experts", src, lo=0, optional=True) or 0
    grouped = method != "greedy"
    groups = _int(cfg, "n_group", src) if grouped else 1
    topk_group = _int(cfg, "topk_group", src) if grouped else 1
    if experts % groups:
        raise CheckpointError(f"{src}: n_routed_experts {experts} is not a multiple of n_group "
                              f"{groups}")
    if topk_group > groups:
        raise CheckpointError(f"{src}: topk_group {topk_group} exceeds n_group {groups}")
    if method == "noaux_tc" and experts // groups < 2:
        raise CheckpointError(f"{src}: noaux_tc routing scores a group by its best two experts; "
                              f"n_routed_experts / n_group = {experts // groups}")
    if top_k > topk_group * (experts // groups):
        raise CheckpointError(f"{src}: num_experts_per_tok {top_k} exceeds the experts of "
                              f"topk_group {topk_group} groups ({topk_group * experts // groups})")
    scale = cfg.get("routed_scaling_factor")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise CheckpointError(f"{src}: routed_scaling_factor must be a number, got {scale!r}")
    return {
        "n_routed_experts": experts,
        "num_experts_per_tok": top_k,
        "n_shared_experts": shared,
        "moe_intermediate_size": _int(cfg, "moe_intermediate_size", src),
        "first_k_dense_replace": first_dense,
        "n_group": groups,
        "topk_group": topk_group,
        "scoring_func": scoring,
        "topk_method": method,
        "norm_topk_prob": bool(norm),
        "routed_scaling_factor": float(scale),
    }


def weight_files(directory: str | Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The checkpoint's safetensors files and, when sharded, its tensor -> file map."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if regular_file(index, "the safetensors index", CheckpointError):
        data = load_json(index, "safetensors index")
        wmap = data.get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise CheckpointError(f"{index}: no weight_map")
        owners = {k: d / str(v) for k, v in wmap.items()}
        files = sorted(set(owners.values()))
        for f in files:
            if not regular_file(f, "a weight file", CheckpointError):
                raise CheckpointError(f"{index}: lists {f.name}, which is missing")
        return files, owners
    single = d / "model.safetensors"
    if regular_file(single, "the weight file", CheckpointError):
        return [single], None
    others = sorted(p.name for p in d.glob("*.bin")) if d.is_dir() else []
    hint = f" (found {', '.join(others)}: only safetensors weights are read)" if others else ""
    raise CheckpointError(f"{d}: no model.safetensors or model.safetensors.index.json{hint}")


def _stored_dtype(files: list[Path]) -> str | None:
    """The dtype of the stored embedding (used when config.json names no dtype)."""
    from safetensors import safe_open
    for f in files:
        with safe_open(str(f), framework="numpy") as st:
            if "model.embed_tokens.weight" in st.keys():
                return DTYPES.get(st.get_slice("model.embed_tokens.weight").get_dtype())
    return None


def read_hf_config(directory: str | Path) -> dict:
    """``ModelConfig`` keyword arguments of the checkpoint in ``directory``."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory")
    raw = load_json(d / "config.json", "config.json")
    src = str(d / "config.json")
    stored = None
    if not (raw.get("dtype") or raw.get("torch_dtype")):
        if not is_kimi(raw):
            architecture(raw, src)  # the architecture error comes first
        stored = _stored_dtype(weight_files(d)[0])
    if is_kimi(raw):  # hybrid MLA + KDA: the MLA part (num_layers = its MLA layers)
        return parse_kimi_config(raw, src, stored)[0]
    return parse_config(raw, src, stored)


def kv_shape(directory: str | Path) -> dict[str, Any]:
    """What the KV cache needs: ``num_layers``, ``kv_lora_rank``, ``rope_dim``, ``dtype`` (plus
    ``hidden_size``, ``num_heads``, ``vocab_size`` for the policy file's [model] section)."""
    c = read_hf_config(directory)
    return {"num_layers": c["num_layers"], "kv_lora_rank": c["kv_lora_rank"],
            "rope_dim": c["qk_rope_head_dim"], "dtype": c["dtype"],
            "hidden_size": c["hidden_size"], "num_heads": c["num_heads"],
            "vocab_size": c["vocab_size"]}


def state_shape(directory: str | Path) -> tuple[int, int, int] | None:
    """A hybrid (Kimi Linear) checkpoint's KDA state per request: ``(kda layers, short-conv
    elements per layer, recurrent elements per layer)``; None for a checkpoint without KDA."""
    d = Path(directory)
    raw = load_json(d / "config.json", "config.json")
    if not is_kimi(raw):
        return None
    src = str(d / "config.json")
    hybrid = parse_kimi_config(raw, src, "float32")[1]
    heads, dim, kernel = hybrid["kda_heads"], hybrid["kda_head_dim"], hybrid["conv_kernel"]
    kda = sum(k == "linear_attention" for k in hybrid["layer_types"])
    return kda, 3 * heads * dim * (kernel - 1), heads * dim * dim
