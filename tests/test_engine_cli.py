"""``hicache decode``: argument errors, the in-process dcp=1 run, JSON output."""

import argparse
import json
import re

import pytest

from hicache.commands import decode as cli
from hicache.engine.model import MLAModel, ModelConfig



def parse(*argv):
    parser = argparse.ArgumentParser(prog="hicache")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_parser(sub)
    return parser.parse_args(["decode", *argv])


def test_json_run_matches_reference(capsys):
    rc = cli.run(parse("--dcp", "1", "--prompt-len", "7", "--new-tokens", "4", "--seed", "3",
                       "--json", "--verify"))
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["verified"]
    assert len(out["tokens"]) == 4 and out["tokens"] == out["reference_tokens"]
    assert out["kv_rows_per_rank"] == [11]
    cfg = ModelConfig(seed=3)
    assert out["kv_bytes_per_rank"] == [11 * cfg.kv_dim * 4 * cfg.num_layers]
    assert out["collectives_per_layer"] == 0
    assert out["step_time_s"] > 0
    assert out["pcp"] == 1 and out["prefill_time_s"] > 0


def test_text_run_with_saved_model(tmp_path, capsys):
    path = tmp_path / "m.pt"
    MLAModel(ModelConfig(num_layers=1, seed=9)).save(path)
    rc = cli.run(parse("--model", str(path), "--prompt-len", "3", "--new-tokens", "2", "--verify"))
    text = capsys.readouterr().out
    assert rc == 0
    assert "tokens: [" in text and "rank 0: kv rows 5" in text and "verify: OK" in text


@pytest.mark.parametrize("argv, needle", [
    (("--backend", "ring"), "--backend must be one of"),
    (("--dcp", "3"), "does not divide"),
    (("--dcp", "0"), "--dcp must be in [1, 256]"),
    (("--timeout", "0"), "--timeout must be a number of seconds in (0, 86400]"),
    (("--timeout", "nan"), "--timeout must be"),
    (("--page-size", "100000000"), "--page-size must be in [1, 65536]"),
    (("--dcp", "4", "--tp", "6"), "--dcp 4 with --tp 6"),
    (("--new-tokens", "-1"), "--new-tokens"),
    (("--model", "/nonexistent/m.pt"), "--model: model file not found"),
])
def test_bad_arguments_are_one_clear_line(argv, needle, capsys):
    with pytest.raises(cli.UsageError, match=re.escape(needle)):
        cli.run(parse(*argv))
    assert cli.main(["decode", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
