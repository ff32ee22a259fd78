"""``hicache decode --spec`` and the ``[spec]`` policy section: the JSON report, and bad input as
exit 2 with one line naming it (no MTP tensors, another vocabulary, k out of 1..8, misspelled
keys)."""

import json
import shutil
import subprocess
import sys

import pytest

from helpers import policy_toml
from spec_ckpt import make_mtp_checkpoint

from hicache.commands import cli
from hicache.config import loads
from hicache.errors import ConfigError


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("speccli")
    make_mtp_checkpoint(root / "target", seed=1)
    shutil.copytree(root / "target", root / "same")
    make_mtp_checkpoint(root / "plain", seed=1, with_mtp=False)
    make_mtp_checkpoint(root / "vocab64", seed=2, vocab=64)
    for name in ("good", "typo", "k9", "nodraft"):
        body = {"good": '[spec]\nmethod = "mtp"\nnum_draft_tokens = 4\n',
                "typo": '[spec]\nmethd = "mtp"\n',
                "k9": '[spec]\nmethod = "mtp"\nnum_draft_tokens = 9\n',
                "nodraft": '[spec]\nmethod = "draft"\n'}[name]
        (root / f"{name}.toml").write_text(policy_toml() + body)
    return {k: str(root / k) for k in ("target", "same", "plain", "vocab64")} | {
        f"{k}_toml": str(root / f"{k}.toml") for k in ("good", "typo", "k9", "nodraft")}


def run(argv, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


BAD = [
    (["--model", "{plain}", "--spec", "mtp"],
     "has no MTP modules (config.json num_nextn_predict_layers is 0 or absent)"),
    (["--model", "{target}", "--spec", "draft", "--draft-model", "{vocab64}"],
     "vocabulary size 64 differs from the target's 96"),
    (["--model", "{target}", "--spec", "mtp", "--num-draft-tokens", "9"],
     "--num-draft-tokens must be in [1, 8], got 9"),
    (["--model", "{target}", "--spec", "mtp", "--num-draft-tokens", "0"],
     "--num-draft-tokens must be in [1, 8], got 0"),
    (["--model", "{target}", "--spec", "mtpp"], "--spec must be one of none, mtp, draft"),
    (["--model", "{target}", "--spec", "draft"], "--draft-model DIR is needed with --spec draft"),
    (["--spec", "mtp"], "needs the target to be a checkpoint directory"),
    (["--model", "{target}", "--spec", "draft", "--draft-model", "{target}/nope"],
     "--draft-model: model file not found"),
]


@pytest.mark.parametrize("args, line", BAD, ids=[" ".join(a[-2:]) for a, _ in BAD])
def test_bad_spec_input_is_one_line(ck, capsys, args, line):
    argv = ["decode"] + [a.format(**ck) for a in args]
    rc, out, err = run(argv, capsys)
    errs = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and "Traceback" not in out + err, (out, err)
    assert len(errs) == 1 and line in errs[0], errs


def test_bad_spec_as_a_real_process(ck):
    r = subprocess.run([sys.executable, "-m", "hicache.commands.cli", "decode", "--model",
                        ck["plain"],
                        "--spec", "mtp"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (err,) = r.stderr.strip().splitlines()
    assert "has no MTP modules" in err


def test_policy_spec_section(ck, capsys):
    cfg = loads(policy_toml() + '[spec]\nmethod = "draft"\ndraft_model = "/x"\n'
                'num_draft_tokens = 8\n')
    assert (cfg.spec.method, cfg.spec.draft_model, cfg.spec.num_draft_tokens) == \
        ("draft", "/x", 8)
    assert loads(policy_toml()).spec.method == "none"
    for text, msg in (('[spec]\nmethd = "mtp"\n', "spec.methd: unknown key (did you mean "
                                                    "'method'?)"),
                      ('[spec]\nmethod = "eagle"\n', "spec.method: 'eagle' is not one of"),
                      ('[spec]\nnum_draft_tokens = 0\n', "spec.num_draft_tokens: 0 is out of "
                                                         "range [1, 8]"),
                      ('[spec]\nnum_draft_tokens = true\n', "spec.num_draft_tokens: expected int"),
                      ('[spec]\nmethod = "draft"\n', "spec.draft_model: method 'draft' needs"),
                      ('[spec]\ndraft_model = "/x"\n', "spec.draft_model: given, but spec.method "
                                                       "is 'none'")):
        with pytest.raises(ConfigError) as e:
            loads(policy_toml() + text)
        assert msg in str(e.value), str(e.value)
    rc, out, err = run(["check-config", ck["good_toml"]], capsys)
    assert rc == 0, err
    for name, msg in (("typo", "spec.methd: unknown key"), ("k9", "spec.num_draft_tokens: 9"),
                      ("nodraft", "spec.draft_model")):
        rc, out, err = run(["check-config", ck[f"{name}_toml"]], capsys)
        errs = [x for x in err.splitlines() if x.strip()]
        assert rc == 2 and len(errs) == 1 and msg in errs[0], (name, errs)


def test_decode_json_reports_speculation(ck, capsys):
    """A draft identical to the target: every proposal accepted, plain decoding's tokens."""
    rc, out, err = run(["decode", "--model", ck["target"], "--prompt-len", "9",
                        "--new-tokens", "9", "--spec", "draft", "--draft-model", ck["same"],
                        "--num-draft-tokens", "3", "--verify", "--json"], capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert res["verified"] and res["tokens"] == res["reference_tokens"]
    sp = res["speculative"]
    assert set(sp) == {"proposed", "accepted", "acceptance_rate", "mean_accepted_len",
                       "target_steps", "tokens_per_target_step", "draft_recomputed_tokens"}
    assert sp["acceptance_rate"] == 1.0 and sp["target_steps"] == 2  # 8 tokens: 4 + 4
    assert sp["tokens_per_target_step"] == 4.0 and sp["mean_accepted_len"] == 3.0
    assert res["tpot_s"] > 0
    rc, out, err = run(["decode", "--model", ck["target"], "--prompt-len", "9",
                        "--new-tokens", "9", "--spec", "mtp", "--verify", "--json"], capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert res["verified"] and res["speculative"]["proposed"] > 0


def test_bench_spec_json():
    """bench/spec.py runs and reports plain and speculative rows of the same run."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "bench" / "spec.py"), "--quick", "--json",
                        "--dcp", "1", "--k", "2", "--prompt-len", "16", "--new-tokens", "7"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    plain, spec = out["rows"]
    assert (plain["spec"], spec["spec"], spec["k"]) == ("none", "draft", 2)
    assert plain["tpot_ratio"] == 1.0 and spec["tpot_ratio"] > 0
    assert spec["acceptance_rate"] == 1.0 and spec["tokens_per_target_step"] == 3.0
    assert spec["tokens_match"] and spec["draft_kv_bytes_per_rank"] > 0
