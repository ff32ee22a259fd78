"""Kimi Linear config.json parsing (pure) and ``hicache plan --model kimi-linear-48b-a3b``.

The published Kimi-Linear-48B-A3B config below goes through the engine's parser; the plan preset
must say the same: which layers are striped (MLA), which hold state (KDA), KV bytes per token per
rank and snapshot bytes (about 2 MB per KDA layer in fp32).
"""

import json

import pytest

from hicache.commands import cli
from hicache.engine.kimi import HybridConfig
from hicache.checkpoints.kimi_config import parse_kimi_config
from hicache.engine.model import ModelConfig
from hicache.errors import CheckpointError

PUBLISHED = {  # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (the fields that matter)
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
    "head_dim": 72, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "dtype": "bfloat16", "tie_word_embeddings": False,
    "first_k_dense_replace": 1, "moe_intermediate_size": 1024, "moe_layer_freq": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_experts": 256,
    "num_experts_per_token": 8, "num_shared_experts": 1, "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128, "num_heads": 32,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25,
                       26]},
    "pad_token_id": 163839, "bos_token_id": 163584, "eos_token_id": 163586,
}


def parsed(raw):
    mla, hyb = parse_kimi_config(raw)
    return ModelConfig(**mla), HybridConfig(**hyb)


def test_published_config_and_plan_preset_agree(capsys):
    cfg, hyb = parsed(PUBLISHED)
    assert cfg.num_layers == 7 and hyb.num_layers == 27
    assert [i + 1 for i in hyb.mla_layers] == [4, 8, 12, 16, 20, 24, 27]
    assert len(hyb.kda_layers) == 20
    assert hyb.mlp_layer_types[0] == "dense" and set(hyb.mlp_layer_types[1:]) == {"sparse"}
    m = cfg.moe
    assert (m.n_routed_experts, m.num_experts_per_tok, m.n_shared_experts, m.scoring_func,
            m.norm_topk_prob) == (256, 8, 1, "sigmoid", True)
    assert cfg.kv_bytes_per_token() == 7 * 576 * 2
    assert cli.main(["plan", "--model", "kimi-linear-48b-a3b", "--tp", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    h = out["hybrid"]
    assert h["striped_mla_layers"] == [i + 1 for i in hyb.mla_layers]
    assert h["state_kda_layers"] == [i + 1 for i in hyb.kda_layers]
    assert h["kda_state_bytes_per_layer"] == hyb.state_bytes_per_layer(2)
    assert h["kda_recurrent_state_bytes_per_layer"] == 32 * 128 * 128 * 4  # 2 MiB
    assert h["snapshot_bytes"] == hyb.snapshot_bytes(2) == 20 * hyb.state_bytes_per_layer(2)
    rows = {r["dcp"]: r["kv_bytes_per_token_per_rank"] for r in out["rows"]}
    assert rows[1] == cfg.kv_bytes_per_token() and rows[4] == cfg.kv_bytes_per_token() / 4
    assert cli.main(["plan", "--model", "kimi-linear-48b-a3b", "--tp", "8"]) == 0
    text = capsys.readouterr().out
    assert "striped (MLA KV" in text and "snapshot 43417600 bytes" in text


def test_layer_kinds_from_types_lists_or_default():
    raw = dict(PUBLISHED, num_hidden_layers=5, linear_attn_config={})
    _, hyb = parsed(raw)  # transformers' default: every 4th layer after the first is MLA
    assert hyb.layer_types == ("linear_attention",) * 4 + ("full_attention",)
    kinds = ["full_attention", "linear_attention", "linear_attention"]
    raw = dict(PUBLISHED, num_hidden_layers=3, layer_types=kinds,
               mlp_layer_types=["sparse", "dense", "sparse"], linear_attn_config={})
    cfg, hyb = parsed(raw)
    assert hyb.layer_types == tuple(kinds) and hyb.mlp_layer_types == ("sparse", "dense",
                                                                       "sparse")
    assert cfg.num_layers == 1


@pytest.mark.parametrize("change, needle", [
    (dict(layer_types=["linear_attention"] * 26 + ["mamba"]),
     "layer_types[26] 'mamba' is not a known layer type"),
    (dict(layer_types=["linear_attention"] * 3), "layer_types must list 27 layer kinds"),
    (dict(mlp_layer_types=["dense"] * 26 + ["moe"]), "mlp_layer_types[26] 'moe'"),
    (dict(linear_attn_config={"kda_layers": [0], "full_attn_layers": [1]}),
     "linear_attn_config.kda_layers holds 0; layer numbers are 1-indexed in [1, 27]"),
    (dict(linear_attn_config={"kda_layers": [1, 2], "full_attn_layers": [2]}),
     "layer 2 is listed twice"),
    (dict(linear_attn_config={"kda_layers": [1], "full_attn_layers": [2]}),
     "lists no kind for layer 3 (1-indexed) of 27"),
    (dict(num_hidden_layers=2, linear_attn_config={"kda_layers": [1, 2],
                                                   "full_attn_layers": []}),
     "no full_attention layer"),
    (dict(mla_use_nope=False), "mla_use_nope False is not supported"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func 'softmax'"),
    (dict(num_key_value_heads=8), "num_key_value_heads 8 is not supported"),
    (dict(num_experts=255, num_expert_group=2), "num_experts 255 is not a multiple of num_expert_group"),
    (dict(linear_attn_config=dict(PUBLISHED["linear_attn_config"], num_heads=0)),
     "linear_attn_config.num_heads must be"),
    (dict(dtype="int8"), "dtype 'int8' is not supported"),
])
def test_bad_configs_name_the_key(change, needle):
    with pytest.raises(CheckpointError) as e:
        parsed(dict(PUBLISHED, **change))
    assert needle in str(e.value) and "\n" not in str(e.value)
