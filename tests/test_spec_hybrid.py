"""Speculative decoding on a hybrid target (Kimi Linear: MLA + KDA layers).

The target verifies ``[last, d_1..d_k]`` in one step through its KDA layers keeping the KDA
state (conv window and recurrent matrix) after every position (``HybridRunner.verify_batch``),
so a rejection rolls the state back to the accepted position without recompute
(``rewind``). Checked against plain decoding: the tokens, and after decoding the target's KDA
state and its MLA KV rows equal those of a plain decode of the same committed sequence, with a
hybrid draft (a perturbed copy of the target, itself rolled back) and a DeepSeek-shaped draft.
At DCP 2 through ``hicache decode`` (real gloo ranks); ``--spec mtp`` on a checkpoint without
MTP modules is one line, exit 2.
"""

import json

import pytest
import torch

from spec_ckpt import make_mtp_checkpoint, perturbed_copy
from test_kimi_engine import VOCAB, make_checkpoint, make_runner, prompt_of

from hicache.checkpoints import hf
from hicache.engine.runner import RequestState, reserve
from hicache.engine.spec import DraftModelDrafter, SpecStats, replicated_runner, \
    speculative_generate
from hicache.errors import UsageError
from hicache.pages import PageAllocator

NEW = 14


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_hybrid")
    make_checkpoint(root / "kimi", kda=[1, 2, 4], full=[3], first_dense=1, seed=3)
    perturbed_copy(root / "kimi", root / "kimi_draft", scale=0.6, seed=5)
    make_mtp_checkpoint(root / "ds", seed=6, with_mtp=False, vocab=VOCAB)
    return {k: str(root / k) for k in ("kimi", "kimi_draft", "ds")}


def plain(runner, prompt, new):
    st = RequestState()
    reserve(st, PageAllocator(runner.kv.num_pages), len(prompt) + new, runner.page_tokens)
    out, _ = runner.generate(st, prompt, new)
    return out, st


def speculate(target, draft, prompt, k, new, page=2):
    runner = make_runner(target, pages=64, page_size=page)
    st = RequestState()
    reserve(st, PageAllocator(64), len(prompt) + new, page)
    last = runner.extend(st, prompt)[-1]
    drafter = DraftModelDrafter(replicated_runner(draft, page, 64, "torch"), st.page_table)
    stats = SpecStats()
    out = speculative_generate(runner, st, prompt, last, drafter, k, new, runner.last_hidden,
                               stats)
    return out, st, runner, stats


@pytest.mark.parametrize("draft_name, k", [("kimi_draft", 3), ("ds", 2), ("kimi", 4)])
def test_kimi_target_speculates_losslessly_and_rolls_its_state_back(ck, draft_name, k):
    target = hf.load_model(ck["kimi"])
    draft = hf.load_model(ck[draft_name])
    prompt = prompt_of(11, 9)
    out, st, runner, stats = speculate(target, draft, prompt, k, NEW)
    ref_runner = make_runner(target, pages=64)
    want, ref_st = plain(ref_runner, prompt, NEW - 1)  # feeds all but the last token
    assert out == target.generate(prompt, NEW) and out[:-1] == want
    if draft_name == "kimi":
        assert stats.accepted == stats.proposed > 0  # the target drafting for itself
    else:
        assert stats.proposed > stats.accepted  # rejections: the KDA state was rolled back
    if draft_name == "kimi_draft":
        assert stats.accepted > 0  # and partial acceptance: rolled back past position 0
    # the committed sequence's KDA state and MLA rows equal the plain decode's
    assert st.length == len(prompt) + NEW - 1 == ref_st.length
    mine, ref = runner.states.snapshot(st), ref_runner.states.snapshot(ref_st)
    assert torch.allclose(mine.rec, ref.rec, atol=1e-5) and \
        torch.allclose(mine.conv.float(), ref.conv.float(), atol=1e-5)
    rows = st.slots(0, st.length, 2)
    assert torch.allclose(runner.kv.read(0, rows)[1], ref_runner.kv.read(0, rows)[1],
                          atol=1e-5)


def test_rewind_only_within_a_verify(ck):
    target = hf.load_model(ck["kimi"])
    runner = make_runner(target, pages=16)
    st = RequestState()
    reserve(st, PageAllocator(16), 12, 2)
    runner.extend(st, [5, 6, 7])
    with pytest.raises(UsageError, match="no KDA state kept there"):
        runner.rewind(st, 2)  # a plain extend keeps nothing
    before = runner.states.snapshot(st)
    runner.verify_batch([st], [[8, 9, 10]])
    runner.rewind(st, 4)
    runner.rewind(st, 3)  # back to where the verify started: the state before it
    after = runner.states.snapshot(st)
    assert after.length == 3 and torch.equal(after.rec, before.rec)
    with pytest.raises(UsageError, match="rewind to 5"):
        runner.rewind(st, 5)  # forward is not a rewind


def test_decode_cli_kimi_spec_draft_at_dcp2_and_mtp_says_no_modules(ck, capsys, tmp_path):
    from hicache.commands import decode as cli
    prompt = prompt_of(4, 9)
    target = hf.load_model(ck["kimi"])
    want = target.generate(prompt, NEW)
    ids = ",".join(map(str, prompt))
    rc = cli.main(["decode", "--model", ck["kimi"], "--dcp", "2", "--prompt-ids", ids,
                   "--new-tokens", str(NEW), "--spec", "draft", "--draft-model",
                   ck["kimi_draft"], "--num-draft-tokens", "3", "--json", "--verify"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["tokens"] == want and out["verified"]
    sp = out["speculative"]
    assert sp["proposed"] > sp["accepted"] > 0 and sp["tokens_per_target_step"] > 1
    assert cli.main(["decode", "--model", ck["kimi"], "--prompt-ids", ids, "--spec",
                     "mtp"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "has no MTP modules" in err[0], err
    # a hybrid checkpoint declaring MTP modules: named at layer num_hidden_layers (4), not
    # the MLA layer count (1)
    d = tmp_path / "kimi_mtp"
    d.mkdir()
    (d / "model.safetensors").symlink_to(f"{ck['kimi']}/model.safetensors")
    raw = json.loads(open(f"{ck['kimi']}/config.json").read())
    (d / "config.json").write_text(json.dumps(dict(raw, num_nextn_predict_layers=1)))
    assert cli.main(["decode", "--model", str(d), "--prompt-ids", ids, "--spec", "mtp"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "(layer 4 of num_hidden_layers = 4)" in err[0], err
