"""Import direction: server → engine → core; models never import engine; the core imports
neither torch nor the server (STYLE; one home per concept)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "coda"
CORE = {"errors", "finish", "lifecycle", "trace", "detokenizer", "stops", "stream", "step",
        "request", "loop", "early_stop", "sampling", "scripted", "reader"}
PURE_ENGINE = {"engine/kv_cache", "engine/scheduler", "engine/sequence", "engine/types"}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def module_files() -> dict[str, Path]:
    return {str(p.relative_to(PKG).with_suffix("")): p for p in PKG.rglob("*.py")}


def test_core_modules_import_neither_torch_nor_engine_nor_server() -> None:
    files = module_files()
    for name in CORE | PURE_ENGINE:
        bad = {m for m in imports_of(files[name])
               if m.split(".")[0] == "torch" or m.startswith(("coda.server", "coda.models"))
               or (name in CORE and m.startswith("coda.engine"))}
        assert not bad, f"{name} imports {bad}"


def test_models_never_import_engine_or_server() -> None:
    for name, path in module_files().items():
        if name.startswith("models/"):
            bad = {m for m in imports_of(path) if m.startswith(("coda.engine", "coda.server"))}
            assert not bad, f"{name} imports {bad}"


def test_engine_never_imports_server() -> None:
    for name, path in module_files().items():
        if name.startswith("engine/"):
            bad = {m for m in imports_of(path) if m.startswith("coda.server")}
            assert not bad, f"{name} imports {bad}"


def test_server_reads_streams_only_through_the_one_reader() -> None:
    """Issue 11 item 4: the server imports neither the detokenizer (logprob bytes come on the
    events) nor the engine's internals, and registers no stream listener of its own: every
    live read goes through coda.reader."""
    internals = ("coda.detokenizer", "coda.step", "coda.request", "coda.engine.core",
                 "coda.engine.handle", "coda.engine.async_engine")
    for name, path in module_files().items():
        if name.startswith("server/"):
            bad = {m for m in imports_of(path) if m.startswith(internals)}
            assert not bad, f"{name} imports {bad}"
            assert ".add_listener(" not in path.read_text(encoding="utf-8"), name


def test_core_import_does_not_load_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, coda.loop, coda.step, coda.stream, coda.stops, coda.detokenizer, "
            "coda.engine.scheduler, coda.engine.kv_cache; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
