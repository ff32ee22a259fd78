"""Speculative decoding beside DCP is lossless: greedy tokens equal plain decoding's.

One 4-process gloo launch runs every configuration: DCP 4 (the world), DCP 2 (subgroups {0,1}
and {2,3}) and DCP 1 (each rank alone), both merge backends, with the checkpoint's MTP module, a
draft identical to the target and a draft that mostly agrees (a perturbed LM head, so proposals
are both accepted and rejected); plus PCP 4 prefill with DCP 1, 2 and 4 decode through
``hicache decode``'s per-rank body. The parent compares against the dense reference's greedy
tokens. Also checked: the target pool rows of every committed position equal plain decoding's
(rows written for rejected drafts were overwritten), only committed positions are counted in
the request, a draft identical to the target accepts every proposal, the draft KV is replicated
(every rank holds every row) and costs no DCP collective.
"""

import numpy as np
import pytest
import torch

from spec_ckpt import VOCAB, make_mtp_checkpoint, perturbed_copy

from hicache.distributed import launch
from hicache.commands.decode import DecodeSpec, decode_worker
from hicache.checkpoints.hf import load_model

PAGE = 2
NEW = 10
K = 3
PROMPT = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    make_mtp_checkpoint(root / "target", seed=1)
    import shutil
    shutil.copytree(root / "target", root / "same")
    perturbed_copy(root / "target", root / "near", scale=0.3)
    return {"target": str(root / "target"), "same": str(root / "same"),
            "near": str(root / "near")}


def run_case(paths, prompt, c, rank, group, backend, method, draft):
    """One DCP rank's decode of ``prompt``: plain (method none) or speculative."""
    from hicache.engine.runner import DCPRunner, RequestState, reserve
    from hicache.checkpoints.drafter import make_drafter
    from hicache.engine.spec import SpecSettings, SpecStats, speculative_generate
    from hicache.l1 import DeviceKVPool
    from hicache.layout import DCPLayout
    from hicache.pages import PageAllocator
    model = load_model(paths["target"])
    cfg = model.cfg
    layout = DCPLayout(c, rank, PAGE)
    alloc = PageAllocator(32)
    pool = DeviceKVPool(layout, cfg.num_layers, cfg.kv_dim, cfg.torch_dtype, 32)
    runner = DCPRunner(model, pool, backend=backend, replicate_q=False, group=group,
                       attn_backend="torch")
    st = RequestState()
    reserve(st, alloc, len(prompt) + NEW, layout.page_tokens)
    last = runner.extend(st, prompt)[-1]
    out = {}
    if method == "none":
        toks = []
        for _ in range(NEW):
            toks.append(int(last.argmax()))
            last = runner.extend(st, [toks[-1]])[-1]
    else:
        settings = SpecSettings(method, paths[draft] if draft else "", K)
        drafter = make_drafter(settings, model, paths["target"], layout.page_tokens,
                               st.page_table, alloc.num_pages, "torch")
        stats = SpecStats()
        toks = speculative_generate(runner, st, prompt, last, drafter, K, NEW,
                                    runner.last_hidden, stats)
        out["stats"] = stats.to_dict()
        out["draft_dcp_collectives"] = drafter.runner.stats.dcp_collectives
        out["draft_rows"] = drafter.runner.layout.local_length(drafter.state.length)
        out["draft_length"] = drafter.state.length
    committed = len(prompt) + NEW - 1  # plain decoding also fed its last token
    slots = st.slots(0, committed, layout.page_tokens)
    layers = []
    for i in range(cfg.num_layers):
        _, rows = pool.read(i, slots)
        layers.append(rows.clone().numpy())
    out.update(tokens=toks, length=st.length, rows=layers)
    return out


def group_worker(rank, world, paths, prompt):
    import torch.distributed as dist
    subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    res = {}
    methods = [("none", None), ("mtp", None), ("draft", "same"), ("draft", "near")]
    for c, group in ((4, None), (2, subgroups[rank // 2]), (1, None)):
        for backend in (("a2a", "ag_rs") if c > 1 else ("a2a",)):
            for method, draft in methods:
                res[(c, backend, method, draft)] = run_case(paths, prompt, c, rank % c, group,
                                                            backend, method, draft)
    for dcp in (4, 2, 1):  # PCP 4 prefill, then DCP decode (hicache decode's per-rank body)
        for method, draft in methods[1:3]:
            spec = DecodeSpec(dcp=dcp, pcp=4, backend="ag_rs", prompt_ids=tuple(prompt),
                              prompt_len=len(prompt), new_tokens=NEW, page_size=PAGE,
                              model_path=paths["target"], attn_backend="torch", spec=method,
                              draft_model=paths[draft] if draft else None,
                              num_draft_tokens=K)
            r = decode_worker(rank, world, spec)
            res[("pcp", dcp, method, draft)] = {k: r.get(k) for k in
                                                ("role", "tokens", "speculative")}
    return res


def test_speculative_decoding_is_lossless(paths):
    ref = load_model(paths["target"]).generate(PROMPT, NEW)
    results = launch(4, group_worker, paths, PROMPT, backend="gloo", timeout_s=600)
    near_rates = []
    for rank, res in enumerate(results):
        for key, got in res.items():
            what = f"rank {rank} {key}"
            if key[0] == "pcp":
                if got["role"] != "dcp":
                    continue
                assert got["tokens"] == ref, what
                assert got["speculative"]["target_steps"] > 0, what
                if key[3] == "same":
                    assert got["speculative"]["acceptance_rate"] == 1.0, what
                continue
            c, backend, method, draft = key
            assert got["tokens"] == ref, what
            plain = res[(c, backend, "none", None)]
            # rows of every committed position are plain decoding's: rejected rows overwritten
            for a, b in zip(got["rows"], plain["rows"]):
                assert np.allclose(a, b, atol=1e-5), what
            if method == "none":
                assert got["length"] == len(PROMPT) + NEW, what
                continue
            s = got["stats"]
            assert got["length"] == len(PROMPT) + NEW - 1, what  # the last token is not fed
            assert s["proposed"] > 0 and s["accepted"] <= s["proposed"], what
            assert round(s["tokens_per_target_step"] * s["target_steps"]) == NEW - 1, what
            assert got["draft_dcp_collectives"] == 0, what
            assert got["draft_rows"] == got["draft_length"], what  # replicated: every row here
            if draft == "same":
                assert s["acceptance_rate"] == 1.0, what
                # K + 1 tokens per target step (the last round only what is left)
                assert s["target_steps"] == -(-(NEW - 1) // (K + 1)), what
            if draft == "near":
                near_rates.append(s["acceptance_rate"])
    # the perturbed draft exercises both paths: some proposals accepted, some rejected
    assert near_rates and all(0.0 < r < 1.0 for r in near_rates), near_rates
