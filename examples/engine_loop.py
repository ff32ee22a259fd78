"""A complete engine loop with HiCache embedded, on one rank (dcp = 1) of the built-in MLA engine.

Run it: python examples/engine_loop.py   (the README shows it; tests/test_examples.py runs it)
        python examples/engine_loop.py examples/policy.toml --spec   (speculative: a draft
        model proposes 3 tokens per target step; the cache keeps its KV beside the target's)
"""

import dataclasses
import sys
import tempfile

import numpy as np
import torch

from hicache.errors import ConfigError
from hicache import HiCache, load_config
from hicache.engine.model import MLAModel
from hicache.engine.runner import DCPRunner, RequestState
from hicache.serving import model_config
from hicache.checkpoints.drafter import draft_spec, drafter_for
from hicache.engine.spec import SpecStats, speculative_generate


def main(policy: str = "examples/policy.toml", spec: bool = False) -> list[list[int]]:
    store = tempfile.mkdtemp(prefix="hicache-demo-")
    cfg = load_config(policy).replace(parallel={"tp": 1, "dcp": 1}, l3={"path": store})
    model = MLAModel(model_config(cfg))
    # speculative: a draft of the same vocabulary (here the target's own weights: every
    # proposal is accepted; a real draft is a smaller model or the checkpoint's MTP module)
    draft = MLAModel(dataclasses.replace(model.cfg)) if spec else None
    system = np.random.default_rng(0).integers(0, cfg.model.vocab_size, 200)  # shared prefix
    outputs = []
    # the model's digest names its weights in the L3 keys (or set [model] signature)
    with HiCache(cfg, weights_signature=model.weights_signature(),
                 draft=draft_spec(draft, cfg.page_tokens) if spec else None) as cache:
        model.to(cache.kv.device)                      # the engine runs where L1 lives
        current = {"rid": None}
        runner = DCPRunner(model, cache.kv,  # the engine's KV port: the cache's L1, checked
                           layer_hook=lambda i: cache.wait_layer(current["rid"], i))
        for rid in range(3):
            question = np.random.default_rng(rid + 1).integers(0, cfg.model.vocab_size, 40)
            prompt = np.concatenate([system, question])
            prefix = cache.admit(rid, prompt)          # match L1/L2 (L3: prefetch), lock
            while not prefix.ready:                    # an L3 hit is agreed by all ranks
                cache.step()
            cache.alloc(rid, len(prompt) + 8)          # pages for the suffix and 8 new tokens
            state = RequestState(page_table=prefix.page_table, length=prefix.hit_len)
            current["rid"] = rid                       # wait_layer(i) before layer i
            logits = runner.extend(state, torch.as_tensor(prompt[prefix.hit_len:]))
            if spec:                                   # the draft runs on the cache's draft
                drafter = drafter_for(draft, cfg.page_tokens, prefix.page_table,  # pool
                                      cfg.l1.num_pages, pool=cache.draft.kv)
                stats = SpecStats(draft_recomputed_tokens=drafter.restored(
                    prefix.draft_len, prefix.hit_len))  # the hit's draft KV came back too
                out = speculative_generate(runner, state, prompt, logits[-1], drafter, 3, 8,
                                           hidden=runner.last_hidden, stats=stats)
                cache.finish(rid, np.concatenate([prompt, out[:-1]]),
                             draft_len=drafter.valid_len())  # the draft's pages are cached too
            else:
                out = [int(logits[-1].argmax())]
                for _ in range(7):                     # greedy decode
                    out.append(int(runner.extend(state, [out[-1]])[-1].argmax()))
                cache.finish(rid, np.concatenate([prompt, out[:-1]]))  # cache what was computed
            cache.step()                               # once per scheduler step, every rank
            print(f"request {rid}: reused {prefix.hit_len} of {len(prompt)} prompt tokens "
                  f"(L1 {prefix.device_len}, L2 {prefix.host_len}, L3 {prefix.storage_len}); "
                  f"tokens {out}" + (f"; draft KV reused {prefix.draft_len}, speculative "
                                     f"{stats.to_dict()}" if spec else ""))
            outputs.append(out)
        print(cache.stats()["hit_tokens"])
    return outputs


if __name__ == "__main__":
    try:
        args = [a for a in sys.argv[1:] if a != "--spec"]
        main(*args, spec="--spec" in sys.argv[1:])
    except ConfigError as e:  # a bad or too large policy: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
