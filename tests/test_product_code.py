"""Issue 22 item 5 ("every line of ``coda/`` is product"), at the level of names: every top-level
function and class defined under ``coda/`` is used by ``coda/`` itself (or, decorated, registered
by its decorator: routes, CLI commands), so nothing in the package exists only for tests,
benchmarks or scripts. Module reachability is ``test_architecture``'s; this is the finer grain
(a test-only helper inside a used module, such as a removed ``prompt_inside``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "coda"

# Public names a user of the documented Python API (README "Python API") calls, not coda/.
PUBLIC_API = {
    "ListTraceSink": "the in-memory TraceSink: AsyncEngine.from_model_dir(trace=ListTraceSink())",
}


def unused_names(sources: dict[str, str]) -> list[str]:
    """``file:name`` of each undecorated top-level def/class whose name occurs nowhere in the
    sources except its own definitions (a word match over all text: calls, imports, strings)."""
    defined: dict[str, list[str]] = {}
    for file, text in sources.items():
        for node in ast.parse(text).body:
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and not node.decorator_list):
                defined.setdefault(node.name, []).append(file)
    everything = "\n".join(sources.values())
    out = []
    for name, files in defined.items():
        # NOTE: each definition matches once itself; any other match is a use
        if len(re.findall(rf"\b{re.escape(name)}\b", everything)) <= len(files):
            out.extend(f"{f}:{name}" for f in files)
    return sorted(out)


def test_every_top_level_name_of_coda_is_used_by_coda() -> None:
    """Issue 22 item 5: a name only tests call belongs in ``tests/``."""
    sources = {str(p.relative_to(ROOT.parent)): p.read_text(encoding="utf-8")
               for p in sorted(ROOT.rglob("*.py"))}
    unused = [u for u in unused_names(sources) if u.split(":")[1] not in PUBLIC_API]
    assert not unused, f"defined under coda/ but used only outside it: {unused}"


def test_unused_name_check_finds_a_test_only_helper_and_spares_uses_and_routes() -> None:
    sources = {
        "a.py": "def used():\n    pass\n\ndef helper():\n    pass\n\n"
                "@router.get('/x')\ndef route():\n    pass\n\nclass Twice:\n    pass\n",
        "b.py": "from a import used\n\nclass Twice:\n    pass\n\nused()\n",
    }
    assert unused_names(sources) == ["a.py:Twice", "a.py:helper", "b.py:Twice"]
