"""Hugging Face Kimi Linear checkpoints -> ``KimiLinearModel`` (``hf.load_checkpoint`` calls it).

Tensor names, per layer ``i`` under ``model.layers.i`` (published and ``save_pretrained``
layout): ``input_layernorm``, ``post_attention_layernorm``; MLA layers the DeepSeek
``self_attn.*`` names; KDA layers ``self_attn.{q,k,v}_proj``, ``self_attn.{q,k,v}_conv1d``
[D, 1, K], ``self_attn.A_log`` (H values), ``self_attn.dt_bias`` [D], ``self_attn.f_a_proj``,
``f_b_proj`` (forget gate), ``b_proj`` (beta), ``g_a_proj``, ``g_b_proj`` (output gate),
``o_norm``, ``o_proj``; the feed-forward under ``block_sparse_moe.`` or ``mlp.``: dense
``{gate,up,down}_proj``, sparse ``gate.weight``, ``gate.e_score_correction_bias``,
``experts.E.{w1,w2,w3}``, ``shared_experts.{gate,up,down}_proj``. A layer whose tensors are
those of the other kind (the config's KDA layers do not match the tensors) is a
``CheckpointError`` naming both lists, before any weight is read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hicache.checkpoints.hf import assemble, open_headers
from hicache.checkpoints.hf_config import load_json, weight_files
from hicache.engine.kimi import HybridConfig, KimiLinearModel
from hicache.checkpoints.kimi_config import parse_kimi_config
from hicache.engine.model import ModelConfig
from hicache.errors import CheckpointError

_MLA = {"self_attn.q_proj": "wq", "self_attn.q_a_proj": "wq_a",
        "self_attn.q_a_layernorm": "q_norm", "self_attn.q_b_proj": "wq_b",
        "self_attn.kv_a_proj_with_mqa": "wkv_a", "self_attn.kv_a_layernorm": "kv_norm",
        "self_attn.kv_b_proj": "kv_b_proj", "self_attn.o_proj": "wo"}
_KDA = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv",
        "self_attn.A_log": "a_log", "self_attn.dt_bias": "dt_bias",
        "self_attn.f_a_proj": "wf_a", "self_attn.f_b_proj": "wf_b", "self_attn.b_proj": "wb",
        "self_attn.g_a_proj": "wg_a", "self_attn.g_b_proj": "wg_b",
        "self_attn.o_norm": "o_norm", "self_attn.o_proj": "wo"}
_CONV = ("self_attn.q_conv1d", "self_attn.k_conv1d", "self_attn.v_conv1d")
_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3",
         "w2": "w2"}


def read_kimi_config(directory: str | Path) -> tuple[ModelConfig, HybridConfig]:
    d = Path(directory)
    raw = load_json(d / "config.json", "config.json")
    stored = None
    if not (raw.get("dtype") or raw.get("torch_dtype")):
        from hicache.checkpoints.hf_config import _stored_dtype
        stored = _stored_dtype(weight_files(d)[0])
    mla, hyb = parse_kimi_config(raw, str(d / "config.json"), stored)
    return ModelConfig(**mla), HybridConfig(**hyb)


def _layer_tensors(cfg: ModelConfig, hyb: HybridConfig, i: int, ffn: str
                   ) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint name -> (shape, engine name) of layer ``i``; ``ffn`` its MLP prefix."""
    hs, h, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    p, e = f"model.layers.{i}.", f"layers.{i}."
    out = {p + "input_layernorm.weight": ((hs,), e + "attn_norm"),
           p + "post_attention_layernorm.weight": ((hs,), e + "mlp_norm")}
    if hyb.layer_types[i] == "full_attention":
        shapes = {"self_attn.kv_a_proj_with_mqa": (r + dr, hs), "self_attn.kv_a_layernorm": (r,),
                  "self_attn.kv_b_proj": (h * (dn + dv), r), "self_attn.o_proj": (hs, h * dv)}
        if cfg.q_lora_rank:
            shapes.update({"self_attn.q_a_proj": (cfg.q_lora_rank, hs),
                           "self_attn.q_a_layernorm": (cfg.q_lora_rank,),
                           "self_attn.q_b_proj": (h * (dn + dr), cfg.q_lora_rank)})
        else:
            shapes["self_attn.q_proj"] = (h * (dn + dr), hs)
        for k, shape in shapes.items():
            out[p + k + ".weight"] = (shape, e + _MLA[k])
    else:
        d, hd, heads = hyb.kda_dim, hyb.kda_head_dim, hyb.kda_heads
        shapes = {"self_attn.q_proj": (d, hs), "self_attn.k_proj": (d, hs),
                  "self_attn.v_proj": (d, hs), "self_attn.f_a_proj": (hd, hs),
                  "self_attn.f_b_proj": (d, hd), "self_attn.b_proj": (heads, hs),
                  "self_attn.g_a_proj": (hd, hs), "self_attn.g_b_proj": (d, hd),
                  "self_attn.o_norm": (hd,), "self_attn.o_proj": (hs, d)}
        for k, shape in shapes.items():
            out[p + k + ".weight"] = (shape, e + _KDA[k])
        out[p + "self_attn.A_log"] = ((heads,), e + "a_log")  # any shape of H values
        out[p + "self_attn.dt_bias"] = ((d,), e + "dt_bias")
        for k in _CONV:
            out[p + k + ".weight"] = ((d, 1, hyb.conv_kernel), e + "conv")
    f = p + ffn + "."
    if hyb.mlp_layer_types[i] == "sparse":
        m = cfg.moe
        out[f + "gate.weight"] = ((m.n_routed_experts, hs), e + "moe.gate")
        out[f + "gate.e_score_correction_bias"] = ((m.n_routed_experts,), e + "moe.e_bias")
        inter = m.moe_intermediate_size
        for x in range(m.n_routed_experts):
            for name, shape in (("w1", (inter, hs)), ("w3", (inter, hs)), ("w2", (hs, inter))):
                out[f"{f}experts.{x}.{name}.weight"] = (shape, f"{e}moe.experts.{x}.{name}")
        if m.n_shared_experts:
            inter *= m.n_shared_experts
            for name, shape in (("gate_proj", (inter, hs)), ("up_proj", (inter, hs)),
                                ("down_proj", (hs, inter))):
                out[f"{f}shared_experts.{name}.weight"] = (shape,
                                                           f"{e}moe.shared.{_PROJ[name]}")
    else:
        inter = cfg.intermediate_size
        for name, shape in (("gate_proj", (inter, hs)), ("up_proj", (inter, hs)),
                            ("down_proj", (hs, inter))):
            out[f"{f}{name}.weight"] = (shape, e + _PROJ[name])
    return out


def _check_kinds(d: Path, hyb: HybridConfig, names: set) -> None:
    """The layers holding KDA tensors (``self_attn.A_log``) are the config's KDA layers."""
    held = sorted(int(k.split(".")[2]) for k in names
                  if k.startswith("model.layers.") and k.endswith(".self_attn.A_log")
                  and int(k.split(".")[2]) < hyb.num_layers)
    want = list(hyb.kda_layers)
    if held != want:
        raise CheckpointError(
            f"{d}: config.json has {len(want)} KDA layers {[i + 1 for i in want]} (1-indexed) "
            f"but the tensors hold {len(held)} ({[i + 1 for i in held]}: layers with "
            "self_attn.A_log)")


def load_kimi(directory: str | Path, device=None) -> KimiLinearModel:
    """Build a ``KimiLinearModel`` from a Kimi Linear checkpoint directory."""
    d = Path(directory)
    cfg, hyb = read_kimi_config(d)
    files, _ = weight_files(d)
    where = open_headers(d, files)
    _check_kinds(d, hyb, set(where))
    want = _wanted_tensors(cfg, hyb, where)
    _check_names_and_shapes(d, want, where)
    state = _engine_state(d, cfg, want, where)
    return assemble(d, lambda: KimiLinearModel(cfg, hyb), state, device)


def _wanted_tensors(cfg: ModelConfig, hyb: HybridConfig, where: dict) -> dict:
    """Checkpoint name -> (shape, engine name) of every tensor the config implies (a layer's
    MLP is sparse when the files hold its ``block_sparse_moe`` tensors)."""
    want = {"model.embed_tokens.weight": ((cfg.vocab_size, cfg.hidden_size), "embed_tokens"),
            "model.norm.weight": ((cfg.hidden_size,), "norm")}
    if not cfg.tie_word_embeddings:
        want["lm_head.weight"] = ((cfg.vocab_size, cfg.hidden_size), "lm_head")
    for i in range(hyb.num_layers):
        sparse_names = any(k.startswith(f"model.layers.{i}.block_sparse_moe.") for k in where)
        want.update(_layer_tensors(cfg, hyb, i, "block_sparse_moe" if sparse_names else "mlp"))
    return want


def _check_names_and_shapes(d: Path, want: dict, where: dict) -> None:
    """CheckpointError unless the files hold exactly the wanted tensors (rotary caches aside),
    each of the implied shape (``A_log``: of the implied size)."""
    missing = sorted(set(want) - set(where))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{d}: missing tensors {', '.join(missing[:5])}{more}; "
                              "config.json implies them")
    extra = sorted(k for k in set(where) - set(want) if not k.endswith("rotary_emb.inv_freq"))
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise CheckpointError(f"{d}: unexpected tensors {', '.join(extra[:5])}{more}; "
                              "config.json does not use them")
    for k, (shape, _) in want.items():
        got = tuple(where[k][0].get_slice(k).get_shape())
        ok = (got == shape if not k.endswith("A_log")
              else int(torch.Size(got).numel()) == shape[0])
        if not ok:
            raise CheckpointError(f"{d}: tensor {k} ({where[k][1].name}) has shape "
                                  f"{list(got)}, config.json implies {list(shape)}")


def _engine_state(d: Path, cfg: ModelConfig, want: dict, where: dict) -> dict:
    """The engine's state dict: each wanted tensor read, checked float, cast (the router and
    KDA decay parameters to fp32), ``kv_b_proj`` split per head, q/k/v conv kernels joined."""
    dtype, h, dn = cfg.torch_dtype, cfg.num_heads, cfg.qk_nope_head_dim
    fp32 = ("moe.gate", "moe.e_bias", "a_log", "dt_bias")  # kept in fp32 (as transformers)
    state, convs = {}, {}
    for k, (shape, name) in want.items():
        t = where[k][0].get_tensor(k)
        if not t.is_floating_point():
            raise CheckpointError(f"{d}: tensor {k} has dtype {t.dtype}; expected a float")
        t = t.float() if name.endswith(fp32) else t.to(dtype)
        if name.endswith(".conv"):
            convs.setdefault(name, {})[k.rsplit(".", 2)[-2]] = t[:, 0]
        elif name.endswith("a_log"):
            state[name] = t.reshape(-1)
        elif k.endswith("kv_b_proj.weight"):
            per_head = t.view(h, -1, t.shape[-1])
            state[name.replace("kv_b_proj", "w_uk")] = per_head[:, :dn]
            state[name.replace("kv_b_proj", "w_uv")] = per_head[:, dn:]
        else:
            state[name] = t
    for name, parts in convs.items():  # q | k | v depthwise kernels [3D, K]
        state[name] = torch.cat([parts["q_conv1d"], parts["k_conv1d"], parts["v_conv1d"]])
    return state
