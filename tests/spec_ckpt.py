"""Tiny DeepSeek-V3 checkpoints with MTP tensors, made with transformers (for tests/test_spec_*).

``make_mtp_checkpoint(dir)`` saves a transformers ``DeepseekV3ForCausalLM`` of N + 1 layers, then
rewrites it as a checkpoint of N layers with ``num_nextn_predict_layers = 1``: layer N's decoder
tensors stay in the file (transformers' own names, as ``save_pretrained`` writes them) and the
MTP tensors ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` (and, with ``own_head``,
``shared_head.head``) are added to the safetensors file. Returns the transformers model (N + 1
layers) and the added tensors, for a reference built from transformers' own modules.
"""

import json
import math
import shutil
from pathlib import Path

import torch

from hf_weights import seed_weights

VOCAB = 96
LAYERS = 2  # N: the main model's layers; the MTP module is layer N


def make_mtp_checkpoint(path, *, seed=0, own_head=False, with_mtp=True, moe=True, vocab=VOCAB,
                        far_norm=False):
    """``far_norm``: the main model's final-norm weights spread over [0.2, 4] (far from 1, as
    trained checkpoints' are), so feeding the MTP module the hidden state before or after that
    norm makes a difference."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=LAYERS + 1, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2,
        first_k_dense_replace=1 if moe else LAYERS + 1, max_position_embeddings=256,
        tie_word_embeddings=False, rms_norm_eps=1e-5, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = DeepseekV3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    seed_weights(model, g)
    if far_norm:
        with torch.no_grad():
            hs = cfg.hidden_size
            model.model.norm.weight.copy_(torch.linspace(0.2, 4.0, hs)[torch.randperm(
                hs, generator=g)])
    path = Path(path)
    model.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["num_hidden_layers"] = LAYERS
    raw["num_nextn_predict_layers"] = 1 if with_mtp else 0
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    f = path / "model.safetensors"
    state = load_file(str(f))
    hs = cfg.hidden_size
    p = f"model.layers.{LAYERS}."
    added = {}
    if with_mtp:
        added = {p + "enorm.weight": 1 + 0.1 * torch.randn(hs, generator=g),
                 p + "hnorm.weight": 1 + 0.1 * torch.randn(hs, generator=g),
                 p + "eh_proj.weight": torch.randn(hs, 2 * hs, generator=g) / math.sqrt(2 * hs),
                 p + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hs, generator=g)}
        if own_head:
            added[p + "shared_head.head.weight"] = \
                torch.randn(vocab, hs, generator=g) * 3 / math.sqrt(hs)
        state.update(added)
    else:  # a checkpoint without MTP: layer N's tensors are gone too
        state = {k: v for k, v in state.items() if not k.startswith(p)}
    save_file(state, str(f), metadata={"format": "pt"})
    return model, added


def perturbed_copy(src, dst, scale=0.05, seed=7):
    """A copy of checkpoint ``src`` with noise on its LM head: a draft that mostly agrees."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    f = Path(dst) / "model.safetensors"
    state = load_file(str(f))
    g = torch.Generator().manual_seed(seed)
    w = state["lm_head.weight"]
    state["lm_head.weight"] = w + scale * w.abs().mean() * torch.randn(w.shape, generator=g)
    save_file(state, str(f), metadata={"format": "pt"})
    (Path(dst) / ".hicache-weights-signature.json").unlink(missing_ok=True)
