"""The documentation against the code: every command and flag the README and docs/ show exists,
every policy key is documented (docs/policy.md is the schema's rendering), every link resolves."""

import re
from pathlib import Path

import pytest

from hicache.commands import bench as bench_cli, cli
from hicache.config import describe
from hicache.commands.policy_doc import reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:^|[\s`(])(hicache-bench|hicache)\s+(.*)")


def _subparsers(parser):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            return action.choices
    return {}


def _parser_for(prog: str, words: list[str]):
    """The argparse parser a command line reaches, and the words it has left."""
    parser = bench_cli.build_parser() if prog == "hicache-bench" else cli.build_parser()
    while words and words[0] in _subparsers(parser):
        parser = _subparsers(parser)[words.pop(0)]
    return parser


def command_lines(text: str):
    """(prog, the rest of the line and its continuation lines) for every command shown."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = COMMAND.search(line)
        if not m or "hicache." in m.group(0).split()[0]:
            continue
        rest = m.group(2).split("#")[0]
        j = i + 1
        while j < len(lines) and re.match(r"^\s+(\[?--|#)", lines[j]):  # [--flag ...], # ...
            rest += " " + lines[j].split("#")[0]
            j += 1
        yield m.group(1), rest


def shown_commands():
    out = []
    for doc in DOCS:
        for prog, rest in command_lines(doc.read_text()):
            out.append((doc.relative_to(ROOT).as_posix(), prog, rest))
    return out


def test_the_docs_show_commands():
    progs = {prog for _, prog, _ in shown_commands()}
    assert progs == {"hicache", "hicache-bench"}


@pytest.mark.parametrize("doc,prog,rest", shown_commands())
def test_every_flag_shown_exists(doc, prog, rest):
    words = [w.strip("`:,.()") for w in rest.replace("[", " ").replace("]", " ").split()]
    words = [w for w in words if re.fullmatch(r"[a-z][a-z0-9-]*", w)]
    parser = _parser_for(prog, words)
    known = set(parser._option_string_actions)
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest))
    missing = sorted(flags - known)
    assert not missing, f"{doc}: `{prog} {rest.strip()}` shows {missing}, unknown to {parser.prog}"


def test_a_flag_that_does_not_exist_is_caught():
    parser = _parser_for("hicache", ["plan"])
    assert "--model" in parser._option_string_actions
    assert "--no-such-flag" not in parser._option_string_actions


def test_policy_reference_is_the_schema():
    text = (ROOT / "docs" / "policy.md").read_text()
    assert text == reference(), \
        "docs/policy.md is stale: python -m hicache.commands.policy_doc > docs/policy.md"
    for key, _default, _help in describe():
        section, name = key.rsplit(".", 1)
        assert f"`[{section}]`" in text and f"| `{name}` |" in text, key


def test_links_resolve():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
