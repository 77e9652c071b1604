"""Import direction: server → engine → core; models never import engine; the core imports
neither torch nor the server; no import cycles; the server reads streams only through the one
reader (STYLE; one home per concept; issue 11 item 5); every module of ``coda/`` is product: reached by
imports from what a user runs or imports (issue 22 step 5).

The core is selected by location: every module directly under ``coda/`` is core unless it is
one of the entry points classified in :data:`NOT_CORE`, each with the reason it may import the
engine. A new top-level module is therefore checked as core unless someone classifies it here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "coda"
# NOTE: top-level modules that are entry points, not core; each may import the engine/server
NOT_CORE = {
    "__init__": "the package marker",
    "cli": "the command line: wires models, engine and server together",
    "__main__": "`python -m coda`: the command line's other door",
    "bench": "the benchmark harness behind `coda bench` (imports the engine and torch)",
    "bench_workload": "`coda bench`'s workload and its timed run (submits to the engine)",
}
PURE_ENGINE = {"engine/kv_cache", "engine/kv_integrity", "engine/scheduler", "engine/sequence",
               "engine/types", "engine/plan"}


def imports_of(path: Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            # NOTE: ``from coda import trace`` imports the module coda.trace
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def module_files() -> dict[str, Path]:
    return {str(p.relative_to(PKG).with_suffix("")): p for p in PKG.rglob("*.py")}


def core_modules() -> set[str]:
    return {name for name in module_files() if "/" not in name and name not in NOT_CORE}


def test_not_core_names_existing_modules_only() -> None:
    """A stale classification would silently shrink the checks."""
    assert set(NOT_CORE) <= set(module_files())


def test_core_modules_import_neither_torch_nor_engine_nor_server() -> None:
    files = module_files()
    core = core_modules()
    assert {"request", "output", "stream", "reader"} <= core
    for name in core | PURE_ENGINE:
        bad = {m for m in imports_of(files[name])
               if m.split(".")[0] == "torch"
               or m.startswith(("coda.server", "coda.models", "coda.scaleout", "coda.durable"))
               or (name in core and m.startswith("coda.engine"))}
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


def _graph(*, top_level_only: bool = True) -> dict[str, set[str]]:
    files = module_files()
    names = {("coda." + n.replace("/", ".")).removesuffix(".__init__"): n for n in files}
    graph: dict[str, set[str]] = {}
    for dotted, name in names.items():
        deps = imports_of(files[name], top_level_only=top_level_only)
        graph[dotted] = {d for d in deps if d in names and d != dotted}
    return graph


# NOTE: what a user runs or imports: the `coda` command (serve, bench, trace check, models) and
# the Python API of README "Python API" (engine, request types, sampling, its errors), and the
# per-model worker process's main module (started as `python -m coda.engine.process_worker`
# by coda.engine.process_engine, so no import reaches it); `python -m coda` runs coda.__main__
ENTRY_POINTS = ("coda.cli", "coda.__main__", "coda.server.app", "coda.engine.async_engine", "coda.engine.types",
                "coda.sampling", "coda.errors", "coda.models.config",
                "coda.engine.process_worker")


def reachable(graph: dict[str, set[str]], roots: tuple[str, ...]) -> set[str]:
    """Modules imported, directly or not, from ``roots``; importing ``a.b.c`` also runs the
    packages ``a`` and ``a.b``, so they count as reached."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        parts = mod.split(".")
        parents = (".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(p for p in parents if p in graph)
        todo.extend(graph[mod])
    return seen


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the import graph as a path, or None (iterative three-colour DFS)."""
    colour = dict.fromkeys(graph, 0)
    for root in graph:
        if colour[root]:
            continue
        stack: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        path = [root]
        colour[root] = 1
        while stack:
            node, todo = stack[-1]
            if not todo:
                colour[node] = 2
                stack.pop()
                path.pop()
                continue
            nxt = todo.pop()
            if colour[nxt] == 1:
                return path[path.index(nxt):] + [nxt]
            if colour[nxt] == 0:
                colour[nxt] = 1
                path.append(nxt)
                stack.append((nxt, sorted(graph[nxt])))
    return None


def test_no_import_cycles_at_module_level() -> None:
    """Module-level imports form a DAG (imports inside functions are deliberate late binds)."""
    assert find_cycle(_graph()) is None, find_cycle(_graph())


def test_models_import_graph_is_acyclic_counting_imports_inside_functions() -> None:
    """coda/models: no cycle even through function-level imports (issue 18 item 6: the mode
    table imported the builders inside functions while they imported it back; the builders
    now need no mode table, so every late import points one way)."""
    files = module_files()
    names = {("coda." + n.replace("/", ".")).removesuffix(".__init__"): n
             for n in files if n.startswith("models/")}
    graph = {d: {m for m in imports_of(files[n]) if m in names and m != d}
             for d, n in names.items()}
    assert find_cycle(graph) is None, find_cycle(graph)


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_server_reads_streams_only_through_the_one_reader() -> None:
    """Issue 11 item 4: the server imports neither the detokenizer (logprob bytes come on the
    events) nor the engine's internals, and registers no stream listener of its own: every
    live read goes through coda.reader."""
    internals = ("coda.detokenizer", "coda.output", "coda.request", "coda.engine.core",
                 "coda.engine.async_engine")
    for name, path in module_files().items():
        if name.startswith("server/"):
            bad = {m for m in imports_of(path) if m.startswith(internals)}
            assert not bad, f"{name} imports {bad}"
            assert ".add_listener(" not in path.read_text(encoding="utf-8"), name


def test_core_import_does_not_load_torch() -> None:
    import subprocess
    import sys

    mods = ", ".join(f"coda.{m}" for m in sorted(core_modules()))
    code = (f"import sys, {mods}, coda.engine.scheduler, coda.engine.kv_cache; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_server_reads_the_log_only_through_the_reader_and_nothing_listens_on_a_producer(
) -> None:
    """P2, P3 (issue 22 steps 3, 4): no server module reads a stream's log itself
    (``events_after``: through ``coda.reader``), and no module registers a callback that runs
    on a producer's thread: there is one wake-up channel (``coda.wakeup``), observed on an
    event loop, and ``add_listener`` is gone."""
    for name, path in module_files().items():
        text = path.read_text(encoding="utf-8")
        if name.startswith("server/"):
            assert ".events_after(" not in text, name
        assert ".add_listener(" not in text and "def add_listener" not in text, name


def test_the_durable_log_is_an_engine_wrapper_chosen_once() -> None:
    """Issue 22 step 3: the request path never learns Redis exists. Of the server, only
    ``server/durable.py`` (the choice made when the app is built) imports ``coda.durable`` or
    ``redis``; nothing sets hooks on the store or the engine after construction (``on_put``,
    ``loader``, ``on_detach``, ``bind_log``), and nothing swaps a record's handles."""
    for name, path in module_files().items():
        text = path.read_text(encoding="utf-8")
        if name.startswith("server/") and name != "server/durable":
            bad = {m for m in imports_of(path) if m.startswith(("coda.durable", "redis"))}
            assert not bad, f"{name} imports {bad}"
        for hook in ("on_put", "store.loader", "on_detach", "bind_log", "record.handles ="):
            assert hook not in text, f"{name}: {hook}"


def test_every_module_of_coda_is_reached_from_an_entry_point() -> None:
    """Issue 22 step 5: no module under ``coda/`` is imported only by tests, benchmarks or
    scripts (those live in ``tests/``: the reference loop, the random checkpoint, the
    invariance and structured-output harnesses). Imports inside functions count: the CLI binds
    its commands late."""
    graph = _graph(top_level_only=False)
    assert set(ENTRY_POINTS) <= set(graph), set(ENTRY_POINTS) - set(graph)
    orphans = sorted(set(graph) - reachable(graph, ENTRY_POINTS))
    assert not orphans, f"not reached from {ENTRY_POINTS}: {orphans}"


def test_reachability_counts_parent_packages_and_finds_an_orphan() -> None:
    graph = {"p": set(), "p.a": {"p.b.c"}, "p.b": set(), "p.b.c": set(), "p.d": set()}
    assert reachable(graph, ("p.a",)) == {"p", "p.a", "p.b", "p.b.c"}


def _models_imports(path: Path) -> tuple[set[str], list[tuple[str, list[str]]]]:
    """(coda.* modules ``path`` imports outside any function, type-only ones included; per
    function that imports coda.models modules, its name and those import lines' text)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    outer: set[str] = set()
    late: list[tuple[str, list[str]]] = []

    def names(node: ast.Import | ast.ImportFrom) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name for a in node.names}
        if not node.module or node.level:
            return set()
        return {node.module} | {f"{node.module}.{a.name}" for a in node.names}

    def visit(node: ast.AST, fn: ast.AST | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                own = [c for c in ast.walk(child) if isinstance(c, (ast.Import, ast.ImportFrom))
                       and any(n.startswith("coda.models") for n in names(c))]
                if own:
                    late.append((child.name, ["\n".join(lines[c.lineno - 1:c.end_lineno])
                                              for c in own]))
                continue  # NOTE: nested functions' imports counted with their outer function
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                outer.update(n for n in names(child) if n.startswith("coda."))
            visit(child, fn)

    visit(ast.parse(text), None)
    return outer, late


def _models_graph(collapse: bool) -> dict[str, set[str]]:
    files = module_files()
    mods = {("coda." + n.replace("/", ".")).removesuffix(".__init__"): files[n]
            for n in files if n.startswith("models/")}

    def node(mod: str) -> str:
        # NOTE: collapsed, a subpackage (coda.models.kernels) is one node: a folder's circle
        return ".".join(mod.split(".")[:3]) if collapse else mod

    graph: dict[str, set[str]] = {node(m): set() for m in mods}
    for mod, path in mods.items():
        deps = {node(d) for d in _models_imports(path)[0] if d in mods}
        graph[node(mod)] |= deps - {node(mod)}
    return graph


def test_models_module_level_imports_are_acyclic_and_late_imports_say_why() -> None:
    """Issue 18 item 6: coda/models' imports outside functions (type-only ones included) form
    a DAG, file by file and with each subpackage taken as one node (main had the circle
    kernels -> llama -> attention -> kernels, held open by imports inside functions); an
    import of a coda.models module inside a function is there only to defer a heavy dependency
    (torch, for the torch-free mode table and ``coda models``), and says so with a ``# NOTE:``
    in that function's imports."""
    for collapse in (False, True):
        graph = _models_graph(collapse)
        assert find_cycle(graph) is None, find_cycle(graph)
    unsaid = []
    for name, path in module_files().items():
        if name.startswith("models/"):
            for fn, imports in _models_imports(path)[1]:
                if not any("# NOTE:" in text for text in imports):
                    unsaid.append(f"{name}:{fn}: {imports}")
    assert not unsaid, unsaid


def test_models_import_check_sees_a_folder_circle_and_an_unsaid_late_import(
        tmp_path: Path) -> None:
    """The checks above can fail: a late import without a note is reported, a kept one is not,
    and a circle through a subpackage is found only when the subpackage is one node."""
    src = tmp_path / "m.py"
    src.write_text("import coda.models.config\n\ndef f():\n    from coda.models import llama\n\n"
                   "def g():\n    from coda.models import loader  # NOTE: torch\n")
    outer, late = _models_imports(src)
    assert outer == {"coda.models.config"}
    assert [fn for fn, imports in late if not any("# NOTE:" in t for t in imports)] == ["f"]
    folder = {"coda.models.kernels": {"coda.models.llama"}, "coda.models.llama": {
        "coda.models.kernels"}}
    assert find_cycle(folder) is not None
    files = {"coda.models.kernels.dense": {"coda.models.llama"},
             "coda.models.llama": {"coda.models.kernels.ops"}, "coda.models.kernels.ops": set()}
    assert find_cycle(files) is None
