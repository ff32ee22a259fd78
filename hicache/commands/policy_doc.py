"""The policy-file reference (docs/policy.md), rendered from the schema in ``hicache.config``:
every section and key with its default, its allowed values or range, and its help text.

    python -m hicache.commands.policy_doc > docs/policy.md

(tests/test_docs.py checks it is current)
"""

from __future__ import annotations

import dataclasses

from hicache.config import SECTIONS

HEADER = """# Policy file reference

The offload policy file is TOML. Every key is optional; unknown keys and bad values are refused
with one line naming the key. `examples/policy.toml` is a commented example, and
`hicache check-config FILE` prints what a file resolves to. This page is generated from the
schema (`python -m hicache.commands.policy_doc > docs/policy.md`).
"""


def _allowed(meta: dict) -> str:
    if meta.get("choices"):
        return " \\| ".join(f'`"{c}"`' if c == "" else f"`{c}`" for c in meta["choices"])
    lo, hi = meta.get("min"), meta.get("max")
    if lo is None and hi is None:
        return ""
    return f"{'' if lo is None else lo} .. {'' if hi is None else hi}"


def _default(value) -> str:
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _sections() -> list[tuple[str, type]]:
    """(table name, its dataclass): the policy file's sections, then each registered L3
    backend's ``[l3.<name>]`` table."""
    from hicache.l3 import registry
    return [*SECTIONS.items(),
            *((f"l3.{b}", registry.get(b).section) for b in registry.names())]


def reference() -> str:
    """The whole reference, as Markdown."""
    out = [HEADER]
    for name, kind in _sections():
        out.append(f"\n## `[{name}]`\n")
        doc = (kind.__doc__ or "").strip()
        if doc and not doc.startswith(kind.__name__ + "("):
            out.append(doc.split("\n\n")[0].replace("\n", " ") + "\n")
        out.append("| key | default | allowed | meaning |\n|---|---|---|---|")
        for f in dataclasses.fields(kind):
            if f.name.startswith("_") or "help" not in f.metadata or f.metadata.get("table"):
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_text = " ".join(str(f.metadata["help"]).split()).replace("|", "\\|")
            out.append(f"| `{f.name}` | {_default(default)} | {_allowed(f.metadata)} | "
                       f"{help_text} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
