"""Small functions: no function in ``hicache/`` is over 60 lines (issue 24).

The length of a function is that of its ``def`` node, decorators aside (``end_lineno - lineno
+ 1``), nested functions counted inside their parent and on their own."""

import ast
from pathlib import Path

MAX_LINES = 60
ROOT = Path(__file__).resolve().parent.parent / "hicache"


def long_functions(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``file:line name (N lines)`` of every function under ``root`` longer than ``limit``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    rel = path.relative_to(root.parent)
                    out.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_over_60_lines():
    long = long_functions(ROOT)
    assert not long, (f"{len(long)} function(s) in hicache/ over {MAX_LINES} lines; split "
                      "them into smaller functions with one job each:\n" + "\n".join(long))


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))  # def line + 60 = 61 lines
    (tmp_path / "m.py").write_text("def short():\n    return 1\n\n\nclass C:\n"
                                   "    def long(self):\n"
                                   + "\n".join("    " + line for line in body.splitlines())
                                   + "\n")
    found = long_functions(tmp_path)
    assert found == [f"{tmp_path.name}/m.py:6 long (61 lines)"]
    assert long_functions(tmp_path, limit=61) == []


def test_the_service_stays_a_loop_over_its_parts():
    """The facade keeps to the engine's API (issue 33): service.py under 600 lines, and the
    package's top level holds its core modules only (commands, the serving loop, workloads,
    companions, tiers in their own folders)."""
    lines = len((ROOT / "service.py").read_text().splitlines())
    assert lines < 600, f"hicache/service.py has {lines} lines; move a part into hicache/facade"
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 24, f"{len(top)} top-level modules in hicache/: {top}"
