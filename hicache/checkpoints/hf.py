"""Hugging Face DeepSeek-V2/V3-family checkpoints -> ``MLAModel``; the weights signature.

    model = load_checkpoint("path/to/checkpoint")   # config.json + safetensors, memory-mapped
    model = load_model(path)                        # a directory as above, or an MLAModel.save file
    sig = weights_signature("path/to/checkpoint")   # digest of headers + sampled bytes (signature.py)

Loading reads ``config.json`` (``hicache.checkpoints.hf_config``: unknown architectures and
unsupported values are errors naming the key), then the safetensors headers of
``model.safetensors`` or of every shard of ``model.safetensors.index.json``: a missing tensor,
an unexpected one, or a shape that differs from what ``config.json`` implies is a
``CheckpointError`` naming the tensor, before any weight is read or any compute runs. Weights are
memory-mapped by the ``safetensors`` library (no copy when the stored dtype is the model dtype;
the OS shares the pages between ranks on one node). ``kv_b_proj`` [H*(dn+dv), R] becomes the
absorbed ``w_uk`` [H, dn, R] and ``w_uv`` [H, dv, R] as views of the mapped tensor.

Every DCP rank loads the whole model: DCP shards the KV cache by token, not the weights, and each
rank computes every head of its tokens' attention. Tensor parallelism would split, per rank r of
tp: the heads of ``q_proj``/``q_b_proj`` and ``kv_b_proj`` (rows ``r*H/tp .. (r+1)*H/tp`` of
each head-major block; column-parallel), the matching input columns of ``o_proj``
(row-parallel, one all-reduce), ``gate/up`` rows and ``down`` columns of the dense MLP and the
shared experts; ``q_a_proj``, ``kv_a_proj_with_mqa``, the norms and the router stay replicated,
and routed experts split by expert (expert parallelism) or by their intermediate dim. The runner
already computes a head slice (``layer.query(h, pos, heads)``, ``layer.attn_out(o, heads)``).

Tensor names (published and ``save_pretrained`` layout), per layer ``i`` under ``model.layers.i``:
``input_layernorm``, ``self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}``,
``self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj`` (dense) or ``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias`` (sigmoid scoring), ``mlp.experts.E.{gate,up,down}_proj``,
``mlp.shared_experts.{gate,up,down}_proj`` (MoE); ``model.embed_tokens``, ``model.norm``,
``lm_head`` (absent when tied). Tensors of layers past ``num_hidden_layers`` (DeepSeek-V3's
multi-token-prediction layer) and ``rotary_emb.inv_freq`` buffers are ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from hicache.checks import regular_file
from hicache.checkpoints.hf_config import read_hf_config, weight_files
from hicache.checkpoints.signature import weights_signature
from hicache.engine.model import MLAModel, ModelConfig
from hicache.errors import CheckpointError

__all__ = ["checkpoint_config", "expected_tensors", "load_checkpoint", "load_model",
           "weights_signature"]


def _raise(e: CheckpointError):
    raise CheckpointError(str(e)) from None


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> the shape ``cfg`` implies."""
    hs, h, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    out = {"model.embed_tokens.weight": (cfg.vocab_size, hs), "model.norm.weight": (hs,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, hs)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[p + "input_layernorm.weight"] = (hs,)
        out[p + "post_attention_layernorm.weight"] = (hs,)
        if cfg.q_lora_rank:
            out[a + "q_a_proj.weight"] = (cfg.q_lora_rank, hs)
            out[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            out[a + "q_b_proj.weight"] = (h * (dn + dr), cfg.q_lora_rank)
        else:
            out[a + "q_proj.weight"] = (h * (dn + dr), hs)
        out[a + "kv_a_proj_with_mqa.weight"] = (r + dr, hs)
        out[a + "kv_a_layernorm.weight"] = (r,)
        out[a + "kv_b_proj.weight"] = (h * (dn + dv), r)
        out[a + "o_proj.weight"] = (hs, h * dv)
        if cfg.is_moe_layer(i):
            m = cfg.moe
            out[p + "mlp.gate.weight"] = (m.n_routed_experts, hs)
            if m.scoring_func == "sigmoid":
                out[p + "mlp.gate.e_score_correction_bias"] = (m.n_routed_experts,)
            mlps = [(f"mlp.experts.{e}.", m.moe_intermediate_size)
                    for e in range(m.n_routed_experts)]
            if m.n_shared_experts:
                mlps.append(("mlp.shared_experts.", m.moe_intermediate_size * m.n_shared_experts))
        else:
            mlps = [("mlp.", cfg.intermediate_size)]
        for name, inter in mlps:
            out[p + name + "gate_proj.weight"] = (inter, hs)
            out[p + name + "up_proj.weight"] = (inter, hs)
            out[p + name + "down_proj.weight"] = (hs, inter)
    return out


_TOP = {"model.embed_tokens.weight": "embed_tokens", "model.norm.weight": "norm",
        "lm_head.weight": "lm_head"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
          "self_attn.q_proj": "wq", "self_attn.q_a_proj": "wq_a",
          "self_attn.q_a_layernorm": "q_norm", "self_attn.q_b_proj": "wq_b",
          "self_attn.kv_a_proj_with_mqa": "wkv_a", "self_attn.kv_a_layernorm": "kv_norm",
          "self_attn.kv_b_proj": "kv_b_proj", "self_attn.o_proj": "wo",
          "mlp.gate": "moe.gate", "mlp.gate.e_score_correction_bias": "moe.e_bias"}
_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _engine_name(name: str) -> str:
    """Checkpoint tensor name -> ``MLAModel`` parameter name (``kv_b_proj`` is split later)."""
    if name in _TOP:
        return _TOP[name]
    _, _, i, rest = name.split(".", 3)  # model.layers.<i>.<rest>
    rest = rest.removesuffix(".weight")
    if rest in _LAYER:
        return f"layers.{i}.{_LAYER[rest]}"
    owner, proj = rest.rsplit(".", 1)  # mlp | mlp.shared_experts | mlp.experts.<e>
    if owner == "mlp":
        prefix = ""  # the dense MLP's weights sit on the layer
    elif owner == "mlp.shared_experts":
        prefix = "moe.shared."
    else:
        prefix = f"moe.experts.{owner.split('.')[2]}."
    return f"layers.{i}.{prefix}{_PROJ[proj]}"


def _ignored(name: str, num_layers: int) -> bool:
    if name.endswith("rotary_emb.inv_freq"):
        return True
    parts = name.split(".")
    return (len(parts) > 2 and parts[0] == "model" and parts[1] == "layers"
            and parts[2].isdigit() and int(parts[2]) >= num_layers)


def non_finite(t: torch.Tensor) -> int:
    """How many values of ``t`` are NaN or inf. A sum first (NaN and inf propagate through it;
    a finite tensor's sum overflows only for values near the dtype's limit, which the exact
    count below then clears): a sum streams the weights 20-30x faster than ``isfinite`` on CPU
    (bench/finite_check.py)."""
    if bool(torch.isfinite(t.sum())):
        return 0
    return int((~torch.isfinite(t)).sum())


def _bound(cfg: ModelConfig, where: dict, d: Path) -> None:
    """CheckpointError (one line naming the config.json field) when config.json claims more
    layers, routed experts or vocabulary than the stored tensors hold: checked on the header
    names alone, so a lie costs nothing (no tensor name list of the claimed size is built)."""
    layers: set[int] = set()
    experts = -1
    for k in where:
        parts = k.split(".", 6)
        if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
            layers.add(int(parts[2]))
            if len(parts) > 5 and parts[3] == "mlp" and parts[4] == "experts" \
                    and parts[5].isdigit():
                experts = max(experts, int(parts[5]))
    n = 0
    while n in layers:
        n += 1
    if cfg.num_layers > n:
        raise CheckpointError(f"{d}: config.json num_hidden_layers is {cfg.num_layers} but the "
                              f"checkpoint stores {n} layers (model.layers.0 .. {n - 1})")
    if cfg.moe is not None and cfg.moe.n_routed_experts > experts + 1:
        raise CheckpointError(f"{d}: config.json n_routed_experts is {cfg.moe.n_routed_experts} "
                              f"but the checkpoint stores {experts + 1} experts per layer")
    emb = where.get("model.embed_tokens.weight")
    if emb is not None:
        rows = emb[0].get_slice("model.embed_tokens.weight").get_shape()[0]
        if rows != cfg.vocab_size:
            raise CheckpointError(f"{d}: config.json vocab_size is {cfg.vocab_size} but "
                                  f"model.embed_tokens.weight has {rows} rows")


def _is_kimi_dir(d: Path) -> bool:
    from hicache.checkpoints.hf_config import load_json
    from hicache.checkpoints.kimi_config import is_kimi
    return (d / "config.json").is_file() and is_kimi(load_json(d / "config.json", "config.json"))


def load_checkpoint(directory: str | os.PathLike, device: Optional[str | torch.device] = None,
                    *, check_finite: bool = True) -> MLAModel:
    """Build an ``MLAModel`` from a Hugging Face DeepSeek-V2/V3 checkpoint directory. Every
    weight is checked finite (a tensor holding NaN or inf is refused by name; the check reads
    every weight once: ``check_finite=False`` skips it, see docs/trust.md for its cost)."""
    d = Path(directory)
    if _is_kimi_dir(d):  # hybrid MLA + KDA (hicache.checkpoints.kimi_hf)
        from hicache.checkpoints.kimi_hf import load_kimi
        return load_kimi(d, device)
    try:
        cfg = ModelConfig(**read_hf_config(d))
        files, _ = weight_files(d)
    except CheckpointError as e:
        _raise(e)
    # every header first: names and shapes are checked before any weight is read
    where = open_headers(d, files)
    _bound(cfg, where, d)  # what config.json claims, against the files, before building on it
    want = expected_tensors(cfg)
    _check_names_and_shapes(d, cfg, want, where)
    state = _engine_state(d, cfg, want, where, check_finite)
    return assemble(d, lambda: MLAModel(cfg, init=False), state, device)


def open_headers(d: Path, files) -> dict:
    """Every tensor name of the safetensors ``files`` -> (open file, path); CheckpointError for
    a name stored twice or an unreadable file."""
    from safetensors import safe_open
    where = {}
    try:
        for f in files:
            st = safe_open(str(f), framework="pt", device="cpu")
            for k in st.keys():
                if k in where:
                    raise CheckpointError(f"{d}: tensor {k} is stored twice "
                                          f"({where[k][1].name} and {f.name})")
                where[k] = (st, f)
    except CheckpointError:
        raise
    except Exception as e:  # a corrupt or foreign file
        raise CheckpointError(f"{d}: cannot read safetensors file: {e}") from None
    return where


def _check_names_and_shapes(d: Path, cfg: ModelConfig, want: dict, where: dict) -> None:
    """CheckpointError unless the files hold exactly the tensors ``cfg`` implies (ignored ones
    aside), each of the implied shape."""
    missing = sorted(set(want) - set(where))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{d}: missing tensors {', '.join(missing[:5])}{more}; "
                              "config.json implies them")
    extra = sorted(k for k in set(where) - set(want) if not _ignored(k, cfg.num_layers))
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise CheckpointError(f"{d}: unexpected tensors {', '.join(extra[:5])}{more}; "
                              "config.json does not use them")
    for k, shape in want.items():
        got = tuple(where[k][0].get_slice(k).get_shape())
        if got != shape:
            raise CheckpointError(f"{d}: tensor {k} ({where[k][1].name}) has shape "
                                  f"{list(got)}, config.json implies {list(shape)}")


def _engine_state(d: Path, cfg: ModelConfig, want: dict, where: dict,
                  check_finite: bool) -> dict:
    """The engine's state dict: each wanted tensor read (memory-mapped), checked float and
    finite, cast to the model dtype (the router to fp32), ``kv_b_proj`` split per head."""
    dtype = cfg.torch_dtype
    h, dn = cfg.num_heads, cfg.qk_nope_head_dim
    state = {}
    for k in want:
        t = where[k][0].get_tensor(k)  # memory-mapped
        if not t.is_floating_point():
            raise CheckpointError(f"{d}: tensor {k} has dtype {t.dtype}; expected a float")
        if check_finite and (bad := non_finite(t)):
            raise CheckpointError(f"{d}: tensor {k} ({where[k][1].name}) has {bad} non-finite "
                                  "values (NaN or inf): a corrupt checkpoint")
        name = _engine_name(k)
        if ".moe.gate" in name or ".moe.e_bias" in name:
            t = t.float()  # the router runs in fp32 whatever the checkpoint dtype
        elif t.dtype != dtype:
            t = t.to(dtype)
        if k.endswith("kv_b_proj.weight"):  # [H*(dn+dv), R] -> w_uk [H, dn, R], w_uv [H, dv, R]
            per_head = t.view(h, -1, t.shape[-1])
            state[name.replace("kv_b_proj", "w_uk")] = per_head[:, :dn]
            state[name.replace("kv_b_proj", "w_uv")] = per_head[:, dn:]
        else:
            state[name] = t
    return state


def assemble(d: Path, make, state: dict, device: Optional[str | torch.device]):
    """The model ``make()`` builds on the meta device, given ``state``'s tensors (its names
    exactly), then moved to ``device`` (when given)."""
    with torch.device("meta"):
        model = make()
    own = set(model.state_dict())
    if own != set(state):  # a mapping bug, not a user error
        raise CheckpointError(f"{d}: internal name mapping mismatch: "
                              f"{sorted(own ^ set(state))[:5]}")
    model.load_state_dict(state, strict=True, assign=True)
    if device is not None:
        model.to(device)
    return model


def load_model(path: str | os.PathLike, device: Optional[str | torch.device] = None
               ) -> MLAModel:
    """A checkpoint directory (``load_checkpoint``) or a file written by ``MLAModel.save``."""
    if os.path.isdir(path):
        model = load_checkpoint(path, device)
        # The L3 weights identity names the weights by content (headers + sampled bytes:
        # hicache.checkpoints.signature), never by path, in well under a second.
        model.source_digest = weights_signature(path)
        return model
    regular_file(path, "the model file", CheckpointError)  # stat before open
    return MLAModel.load(path, device)


def checkpoint_config(directory: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint directory (config.json only)."""
    try:
        return ModelConfig(**read_hf_config(directory))
    except CheckpointError as e:
        _raise(e)

