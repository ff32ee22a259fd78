"""``hicache decode --pcp N``: PCP prefill then DCP decode, over real gloo processes.

One launch per configuration: N == C, N > C with a prefill-only helper rank, N > C with a DCP
subgroup, N < C with a PCP subgroup; each must decode the same tokens as the plain ``--pcp 1`` run and the dense reference.
"""

import argparse
import json
import re

import pytest

from hicache.commands import decode as cli
from hicache.layout import DCPLayout

PROMPT, NEW, SEED, PAGE = 7, 3, 3, 4  # 7 tokens: not divisible by 2N for N = 2, 3


def parse(*argv):
    parser = argparse.ArgumentParser(prog="hicache")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_parser(sub)
    return parser.parse_args(["decode", *argv])


def run_json(capsys, *argv):
    rc = cli.run(parse("--prompt-len", str(PROMPT), "--new-tokens", str(NEW), "--seed", str(SEED),
                       "--page-size", str(PAGE), "--json", "--verify", *argv))
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plain_tokens():
    """Tokens of the ordinary in-process --pcp 1 --dcp 1 run."""
    spec = cli.DecodeSpec(prompt_len=PROMPT, new_tokens=NEW, seed=SEED, page_size=PAGE)
    return cli.run_spec(spec)[0]["tokens"]


@pytest.mark.parametrize("pcp, dcp, mode", [
    (2, 2, "ring"),  # PCP N == DCP C: the same two ranks prefill and decode
    (2, 1, "full_kv"),  # rank 1 only helps the prefill; its rows all go to rank 0
    (3, 2, "ring"),  # DCP runs in a 2-rank subgroup of the 3 launched ranks
    (2, 4, "full_kv"),  # the prefill runs in a 2-rank subgroup; ranks 2, 3 only receive rows
])
def test_pcp_prefill_decodes_like_plain_prefill(pcp, dcp, mode, plain_tokens, capsys):
    rc, out = run_json(capsys, "--pcp", str(pcp), "--dcp", str(dcp), "--pcp-mode", mode)
    assert rc == 0 and out["verified"], out
    assert out["tokens"] == out["reference_tokens"] == plain_tokens
    assert out["pcp"] == pcp and out["spec"]["pcp_mode"] == mode
    assert out["prefill_time_s"] > 0
    total = PROMPT + NEW
    # KV is sharded by DCP alone, whatever N: one entry per DCP rank, slot v on rank v mod c
    assert out["kv_rows_per_rank"] == [DCPLayout(dcp, r, PAGE).local_length(total)
                                       for r in range(dcp)]
    assert out["collectives_per_layer"] == (0 if dcp == 1 else 2)


@pytest.mark.parametrize("argv, needle", [
    (("--pcp", "0"), "--pcp must be in [1, 256], got 0"),
    (("--pcp", "-2", "--dcp", "2"), "--pcp must be in [1, 256], got -2"),
    (("--pcp", "2", "--pcp-mode", "tree"), "--pcp-mode must be one of full_kv, ring"),
    (("--pcp", "2", "--dcp", "3"), "does not divide"),
])
def test_bad_pcp_arguments_are_one_clear_line(argv, needle, capsys):
    with pytest.raises(cli.UsageError, match=re.escape(needle)):
        cli.run(parse(*argv))
    assert cli.main(["decode", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_worker_rejects_a_world_that_is_not_max_pcp_dcp():
    with pytest.raises(cli.UsageError, match=r"max\(pcp, dcp\) = 3"):
        cli.decode_worker(0, 2, cli.DecodeSpec(dcp=2, pcp=3))
