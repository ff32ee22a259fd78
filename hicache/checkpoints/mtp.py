"""DeepSeek-V3 MTP modules read from a checkpoint (``hicache.engine.mtp.MTPModule`` is the
module itself): ``num_mtp_modules``, ``mtp_tensors`` (names and shapes, in checking order) and
``load_mtp`` (a missing tensor is a ``CheckpointError`` naming the first one missing)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from hicache.engine.model import MLAModel, ModelConfig
from hicache.engine.mtp import MTP_OPTIONAL, MTPModule
from hicache.errors import CheckpointError

__all__ = ["load_mtp", "main_layers", "mtp_tensors", "num_mtp_modules"]


def num_mtp_modules(directory: str | Path) -> int:
    """``num_nextn_predict_layers`` of ``config.json`` (0 when absent)."""
    from hicache.checkpoints.hf_config import load_json
    raw = load_json(Path(directory) / "config.json", "config.json")
    n = raw.get("num_nextn_predict_layers", 0) or 0
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise CheckpointError(f"{directory}: num_nextn_predict_layers must be an int >= 0, "
                              f"got {n!r}")
    return n


def mtp_tensors(cfg: ModelConfig, index: int = 0) -> dict[str, tuple[int, ...]]:
    """The required tensors of MTP module ``index`` -> shape, in checking order."""
    from hicache.checkpoints.hf import expected_tensors
    hs, li = cfg.hidden_size, cfg.num_layers + index
    p = f"model.layers.{li}."
    out = {p + "enorm.weight": (hs,), p + "hnorm.weight": (hs,),
           p + "eh_proj.weight": (hs, 2 * hs), p + "shared_head.norm.weight": (hs,)}
    # the decoder layer: the main model's names and shapes at index N+j
    full = expected_tensors(dataclasses.replace(cfg, num_layers=li + 1))
    out.update({k: v for k, v in full.items() if k.startswith(p)})
    return out


def main_layers(target) -> int:
    """The main model's layers as ``config.json``'s ``num_hidden_layers`` counts them (MTP
    module j is layer ``main_layers + j``): every layer of a hybrid model, MLA and KDA."""
    hybrid = getattr(target, "hybrid", None)
    return hybrid.num_layers if hybrid is not None else target.cfg.num_layers


def _check_declared(d: Path, target, n: int, index: int) -> None:
    """One line when the checkpoint has no MTP module ``index`` to load."""
    if n == 0:
        raise CheckpointError(f"{d} has no MTP modules (config.json num_nextn_predict_layers "
                              "is 0 or absent); use --spec draft with a draft model")
    if index >= n:
        raise CheckpointError(f"{d}: no MTP module {index} (config.json "
                              f"num_nextn_predict_layers = {n})")
    if getattr(target, "hybrid", None) is not None:
        raise CheckpointError(f"{d}: MTP module {index} of a hybrid (KDA) checkpoint (layer "
                              f"{main_layers(target) + index} of num_hidden_layers = "
                              f"{main_layers(target)}) is not supported; use --spec draft")


def _engine_name(name: str, layer_index: int) -> str:
    """Checkpoint tensor name of the MTP module -> ``MTPModule`` parameter name."""
    from hicache.checkpoints import hf
    p = f"model.layers.{layer_index}."
    rest = name[len(p):]
    fixed = {"enorm.weight": "enorm", "hnorm.weight": "hnorm", "eh_proj.weight": "eh_proj",
             "shared_head.norm.weight": "head_norm", "embed_tokens.weight": "embed_tokens",
             "shared_head.head.weight": "head"}
    if rest in fixed:
        return fixed[rest]
    return "layers.0." + hf._engine_name(name).split(".", 2)[2]  # layers.<i>.<x> -> layers.0.<x>


def load_mtp(directory: str | Path, target: MLAModel, index: int = 0) -> MTPModule:
    """MTP module ``index`` of the checkpoint ``directory`` whose main model is ``target``
    (its embedding and LM head are shared when the module has none of its own)."""
    from safetensors import safe_open
    from hicache.checkpoints.hf_config import weight_files
    d = Path(directory)
    cfg = target.cfg
    n = num_mtp_modules(d)
    _check_declared(d, target, n, index)
    files, _ = weight_files(d)
    where = {}
    try:
        for f in files:
            st = safe_open(str(f), framework="pt", device="cpu")
            for k in st.keys():
                where[k] = st
    except Exception as e:  # a corrupt or foreign file
        raise CheckpointError(f"{d}: cannot read safetensors file: {e}") from None
    want = mtp_tensors(cfg, index)
    li = cfg.num_layers + index
    for k in want:
        if k not in where:
            raise CheckpointError(
                f"{d}: no MTP module {index}: tensor {k} is missing (config.json "
                f"num_nextn_predict_layers = {n}, num_hidden_layers = {cfg.num_layers})")
    opt = {f"model.layers.{li}.{k}": (cfg.vocab_size, cfg.hidden_size) for k in MTP_OPTIONAL}
    for k, shape in list(want.items()) + [(k, s) for k, s in opt.items() if k in where]:
        got = tuple(where[k].get_slice(k).get_shape())
        if got != shape:
            raise CheckpointError(f"{d}: tensor {k} has shape {list(got)}, config.json implies "
                                  f"{list(shape)}")
    dtype, h, dn = cfg.torch_dtype, cfg.num_heads, cfg.qk_nope_head_dim
    state = {}
    for k in list(want) + [k for k in opt if k in where]:
        t = where[k].get_tensor(k)
        if not t.is_floating_point():
            raise CheckpointError(f"{d}: tensor {k} has dtype {t.dtype}; expected a float")
        name = _engine_name(k, li)
        t = t.float() if (".moe.gate" in name or ".moe.e_bias" in name) else t.to(dtype)
        if k.endswith("kv_b_proj.weight"):
            per_head = t.view(h, -1, t.shape[-1])
            state[name.replace("kv_b_proj", "w_uk")] = per_head[:, :dn]
            state[name.replace("kv_b_proj", "w_uv")] = per_head[:, dn:]
        else:
            state[name] = t
    shared_embed = None if "embed_tokens" in state else target.embed_tokens
    shared_head = None if "head" in state else target.head
    with torch.device("meta"):
        mtp = MTPModule(cfg, index)
    if shared_embed is not None:
        mtp.embed_tokens = shared_embed
    if shared_head is not None:
        mtp.head = shared_head
    own = {k for k in mtp.state_dict() if k not in ("embed_tokens", "head")
           or k in state}
    if own != set(state):  # a mapping bug, not a user error
        raise CheckpointError(f"{d}: internal MTP name mapping mismatch: "
                              f"{sorted(own ^ set(state))[:5]}")
    mtp.load_state_dict(state, strict=False, assign=True)
    return mtp.to(target.embed_tokens.device)

