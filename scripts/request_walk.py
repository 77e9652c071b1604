"""Measure one streaming chat's walk through Coda (issue 22): files, objects, re-entries.

Drives ONE streaming ``/v1/chat/completions`` call (or ``--route``'s) with the official
client through the real app (``coda.server.app.create_app`` over the embedded default model, or ``--model``),
in process over httpx's ASGI transport, after one identical warm-up call (lazy imports and
first-call caches are not the request's). ``sys.setprofile`` / ``threading.setprofile`` watch
every thread (event loop, worker threads, the engine thread) from the moment the client
sends until the stream has ended, and report:

- **files**: the ``coda/`` modules with a function executed in that window;
- **objects**: ``coda`` class instances created in the window (an ``__init__`` / ``__new__`` of
  a class defined under ``coda``), as distinct classes and as instances, overall and during
  admission (arrival until the server's ``submit_all`` returns); the classes are also split
  by how often they are made: once or twice (the request's own objects) and at least once per
  output token (``--max-tokens`` times or more: the step's and the token's values);
- **re-entries**, two ways, both along admission (every thread but the engine's, arrival
  until the server's ``submit_all`` returns); a *stop* is a change of module, a stop at a
  module the path already left is a *re-entry*:
  - *all calls*: the innermost ``coda`` module of whatever runs (every helper call counts);
  - *body path* (the issue's walk "following the route's request body"): only calls that
    carry request data — an argument is the route's parsed body or a ``coda`` object made
    from it (constructed by a call holding request data, or returned by a stop) — and the
    returns from them to the nearest such caller (a coroutine parked at an ``await`` has not
    returned);
  and the body path's re-entries counted two ways:
  - ``body_path_reentries`` (the issue's own count, "returns to a module already left"):
    every stop at a module the path left before, a *return* to the caller included. Under it
    any call tree re-enters (each callee's return lands in the caller it left), so "none" is
    reachable only by a body path inside one module;
  - ``body_path_call_reentries``: only stops reached by a *call* into a module the path
    already entered and left before — the data going back to a module, such as an adapter
    calling ``params`` twice, or a value's module called again from another layer. A callee
    returning to its caller is the caller resuming, not the path re-entering it; this is the
    count the goal "never re-enters a module it left" can be met on;
- **max_tokens**: an AST scan of ``coda/`` for comparisons (``<``, ``>``, ...) and derivations
  (assignments, ``or``/``if`` defaults) that involve a token-budget name, listed by name; then
  split by layer: *wire* (the protocol schemas' field declarations), *adapter* (the protocol
  routes that map a wire field onto the internal name), *d1_policy* (the early-stop policy's
  own ``maxTokens``, SPEC D1: another quantity under the same name) and *internal*
  (everything else below the adapters), with the names and the checking modules of the
  internal ones.

``--route`` walks another protocol's plain streaming call instead, each with its official
client: ``anthropic`` (``/v1/messages``), ``responses`` (``/v1/responses``), ``ollama-chat``
(``/api/chat``) or ``ollama-generate`` (``/api/generate``).

Usage: ``python scripts/request_walk.py [--route openai] [--model PATH] [--max-tokens 8]
[--json OUT]``.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import dis
import inspect
import json
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# NOTE: the request's output-token budget under every spelling the code uses (the
# scheduler's and the KV cache's own "budget"s are other quantities and are not counted)
# NOTE: work no request asked for, which may overlap the measured one: the engine's block-manager
# check when it goes idle (between two steps of a request too, when the client is slower than
# the engine), the server's release of the grammar tokenizer's build once it has been idle a
# while (a timer that may fire inside the measured window under load) and that build's thread.
# Their calls are counted apart (``background_files``), so the request's own figures do not
# move with the timing.
# (``check_when_idle``: a function of coda.engine.engine_thread, matched by its name)
BACKGROUND_CALLS = frozenset({"check_when_idle", "GrammarWarmupMiddleware._release"})
BACKGROUND_THREADS = frozenset({"coda-grammar-tokenizer", "coda-torch-libs"})
BUDGET_NAMES = ("max_tokens", "max_output_tokens", "max_completion_tokens", "max_new_tokens",
                "max_tokens_field")


def _method(frame: FrameType) -> str:
    """``Class.method`` of a frame's code (its qualified name's last two parts; a module
    function's name alone)."""
    return ".".join(frame.f_code.co_qualname.split(".")[-2:])


@dataclass
class Walk:
    active: bool = False
    admitting: bool = False
    engine_thread: int | None = None
    files: set[str] = field(default_factory=set)
    classes: Counter[str] = field(default_factory=Counter)
    admission_classes: Counter[str] = field(default_factory=Counter)
    seen: dict[int, object] = field(default_factory=dict)
    current: dict[int, str | None] = field(default_factory=dict)
    path: list[str] = field(default_factory=list)
    carriers: dict[int, object] = field(default_factory=dict)
    stop_frames: dict[int, FrameType] = field(default_factory=dict)
    body_path: list[str] = field(default_factory=list)
    body_calls: list[bool] = field(default_factory=list)  # NOTE: per stop: reached by a call
    background_files: set[str] = field(default_factory=set)
    muted: dict[int, int] = field(default_factory=dict)  # NOTE: thread -> its background frame

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.active:
            return
        tid = threading.get_ident()
        if self._background(tid, frame, event):
            return
        if event == "call":
            mod = frame.f_globals.get("__name__", "")
            if isinstance(mod, str) and mod.startswith("coda"):
                self.files.add(mod)
            name = frame.f_code.co_name
            if name == "__init__":
                obj = frame.f_locals.get("self")
                if obj is not None:
                    self._made(obj)
            self._move(tid, frame)
            if self.admitting and tid != self.engine_thread and str(mod).startswith("coda"):
                self._carry(frame, str(mod))
        elif event == "return":
            if frame.f_code.co_name == "__new__" and arg is not None:
                self._made(arg)
            if suspended(frame):
                return  # NOTE: an await parks the coroutine; it has not returned
            if self.stop_frames.pop(id(frame), None) is not None:
                self._returned(frame, arg)
            if (frame.f_code.co_name == "submit_all"
                    and str(frame.f_globals.get("__name__", "")).startswith("coda.server")):
                self.admitting = False
            self._move(tid, frame.f_back)

    def _background(self, tid: int, frame: FrameType, event: str) -> bool:
        """A call of work no request asked for (``BACKGROUND_*``): its modules are noted in
        ``background_files`` and nothing else is counted until its frame returns."""
        muted = self.muted.get(tid)
        if muted is None:
            if threading.current_thread().name not in BACKGROUND_THREADS and (
                    event != "call" or _method(frame) not in BACKGROUND_CALLS):
                return False
            if threading.current_thread().name not in BACKGROUND_THREADS:
                self.muted[tid] = id(frame)
        elif event == "return" and id(frame) == muted:
            del self.muted[tid]
        if event == "call":
            mod = frame.f_globals.get("__name__", "")
            if isinstance(mod, str) and mod.startswith("coda"):
                self.background_files.add(mod)
        return True

    def _made(self, obj: object) -> None:
        cls = type(obj)
        if not cls.__module__.startswith("coda") or id(obj) in self.seen:
            return
        self.seen[id(obj)] = obj  # NOTE: kept alive, so an id is never reused in the window
        name = f"{cls.__module__}.{cls.__qualname__}"
        self.classes[name] += 1
        if self.admitting:
            self.admission_classes[name] += 1

    # -- the body path: calls that carry the request's data ------------------------------------
    def _carry(self, frame: FrameType, mod: str) -> None:
        """A call is a stop of the body path when an argument is request data: the route's
        parsed body, or a coda object made from it (by a call holding request data)."""
        code = frame.f_code
        nargs = (code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4)
                 + bool(code.co_flags & 8))
        local = frame.f_locals
        args = [local.get(n) for n in code.co_varnames[:nargs]]
        if not self.carriers and mod.endswith("_routes") and "body" in code.co_varnames[:nargs]:
            self.carriers[id(local["body"])] = local["body"]  # NOTE: the walk starts here
        if not any(self._carries(a) for a in args):
            caller = frame.f_back
            made_here = (code.co_name == "__init__" and caller is not None
                         and any(self._carries(v) for v in caller.f_locals.values()))
            if not made_here:
                return
        if code.co_name == "__init__":
            self.carriers[id(args[0])] = args[0]
        self.stop_frames[id(frame)] = frame
        self._step(mod, call=True)

    def _carries(self, value: object) -> bool:
        if isinstance(value, tuple | list):
            return any(id(v) in self.carriers for v in value[:8])
        return id(value) in self.carriers

    def _returned(self, frame: FrameType, value: object) -> None:
        for v in (value if isinstance(value, tuple | list) else (value,))[:8]:
            if type(v).__module__.startswith("coda"):
                self.carriers[id(v)] = v
        up = frame.f_back
        while up is not None and id(up) not in self.stop_frames:
            up = up.f_back
        if up is not None:
            self._step(str(up.f_globals["__name__"]), call=False)

    def _step(self, mod: str, *, call: bool) -> None:
        if not self.body_path or self.body_path[-1] != mod:
            self.body_path.append(mod)
            self.body_calls.append(call)

    def _move(self, tid: int, frame: FrameType | None) -> None:
        while frame is not None:
            mod = frame.f_globals.get("__name__", "")
            if isinstance(mod, str) and mod.startswith("coda"):
                break
            frame = frame.f_back
        mod = frame.f_globals["__name__"] if frame is not None else None
        if self.current.get(tid) == mod:
            return
        self.current[tid] = mod
        if (self.admitting and tid != self.engine_thread and mod is not None
                and (not self.path or self.path[-1] != mod)):
            self.path.append(mod)


_COROUTINE = inspect.CO_COROUTINE | inspect.CO_ITERABLE_COROUTINE | inspect.CO_ASYNC_GENERATOR
_YIELD = dis.opmap["YIELD_VALUE"]


def suspended(frame: FrameType) -> bool:
    """A coroutine's 'return' event at an await (not its end)."""
    code = frame.f_code
    return bool(code.co_flags & _COROUTINE) and code.co_code[frame.f_lasti] == _YIELD


def reentries(path: list[str]) -> int:
    seen: set[str] = set()
    count = 0
    for i, mod in enumerate(path):
        if mod in seen:
            count += 1
        if i:
            seen.add(path[i - 1])
    return count


def call_reentries(path: list[str], calls: list[bool]) -> list[str]:
    """The stops reached by a call into a module the path had entered and left before, as
    ``caller -> callee`` (returns to a caller are not counted: see the module doc)."""
    seen: set[str] = set()
    out = []
    for i, mod in enumerate(path):
        if calls[i] and mod in seen:
            out.append(f"{path[i - 1]} -> {mod}".replace("coda.", ""))
        if i:
            seen.add(path[i - 1])
    return out


TEST_SUPPORT = frozenset({"bench.py", "loop.py", "structured_eval.py", "invariance.py"})


def layer(site: str) -> str:
    """``wire``, ``adapter``, ``d1_policy`` or ``internal`` for a site line of
    :func:`budget_sites`. ``d1_policy``: the early-stop policy's own hard budget (SPEC D1
    ``maxTokens``, a field of the client's policy object, checked by the policy's controller
    and ending the request down the cancel path, D6), another quantity that shares the name."""
    path = site.split()[1].split(":")[0]
    name = path.rsplit("/", 1)[-1]
    if path == "coda/early_stop.py":
        return "d1_policy"
    if path.startswith("coda/server/") and name.endswith("schemas.py"):
        return "wire"
    # NOTE: a protocol's own wire checks (anthropic_checks.py) are its adapter's, split off
    if path.startswith("coda/server/") and name.endswith(("_routes.py", "_checks.py")):
        return "adapter"
    return "internal"


def by_layer(sites: list[str]) -> dict[str, object]:
    """The sites per layer, and the internal ones' names and checking modules."""
    internal = [s for s in sites if layer(s) == "internal"]
    names: Counter[str] = Counter()
    for s in internal:
        names.update(ast.literal_eval(s[s.index("["):]))
    return {
        "layers": dict(Counter(layer(s) for s in sites)),
        "internal_names": dict(names),
        "internal_check_modules": sorted({s.split()[1].split(":")[0] for s in internal
                                          if s.startswith("check")}),
    }


def budget_sites(root: Path) -> tuple[list[str], Counter[str]]:
    """Checks (comparisons) and derivations (assignments) involving a token-budget name."""

    def names_in(node: ast.AST) -> set[str]:
        out = set()
        for n in ast.walk(node):
            name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(
                n, ast.Attribute) else n.arg if isinstance(n, ast.keyword) else None
            if name and any(name == b or name.endswith("_" + b) for b in BUDGET_NAMES) \
                    and name != "close_within_budget":
                out.add(name)
        return out

    sites: dict[str, set[str]] = {}
    names: Counter[str] = Counter()
    for path in sorted((root / "coda").rglob("*.py")):
        if path.name in TEST_SUPPORT:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                kind = "check"
            elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                kind = "derive"
                if not names_in(node.targets[0] if isinstance(node, ast.Assign)
                                else node.target):
                    continue
            else:
                continue
            found = names_in(node)
            if not found or found <= {"max_tokens_field"}:
                continue
            key = f"{kind} {path.relative_to(root)}:{node.lineno}"
            sites.setdefault(key, set()).update(found)
    for found in sites.values():
        names.update(found)
    return sorted(f"{k} {sorted(v)}" for k, v in sites.items()), names


ROUTES = ("openai", "anthropic", "responses", "ollama-chat", "ollama-generate")


async def drive(app: Any, max_tokens: int, route: str = "openai") -> str:
    """One streaming call of ``route`` with its official client, a plain request (no tools,
    reasoning, logprobs...); the streamed text."""
    import httpx

    model = app.state.coda.engine.model_name
    say = [{"role": "user", "content": "Say hello."}]
    transport = httpx.ASGITransport(app=app)
    text: list[str] = []
    if route.startswith("ollama"):
        import ollama

        client = ollama.AsyncClient(host="http://walk", transport=transport)
        opts = {"num_predict": max_tokens, "temperature": 0}
        if route == "ollama-chat":
            async for part in await client.chat(model=model, messages=say, stream=True,
                                                options=opts):
                text.append(part.message.content or "")
        else:
            async for part in await client.generate(model=model, prompt="Say hello.",
                                                    stream=True, options=opts):
                text.append(part.response or "")
        return "".join(text)
    async with httpx.AsyncClient(transport=transport, base_url="http://walk") as http:
        if route == "anthropic":
            import anthropic
            import httpx2  # NOTE: the anthropic SDK's own httpx

            async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                          base_url="http://walk") as http2:
                an = anthropic.AsyncAnthropic(api_key="x", base_url="http://walk",
                                              http_client=http2)
                # NOTE: this SDK has no temperature keyword: sent as a body field
                events = await an.messages.create(model=model, max_tokens=max_tokens,
                                                  messages=say, stream=True,  # type: ignore[arg-type]
                                                  extra_body={"temperature": 0})
                async for ev in events:
                    if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                        text.append(ev.delta.text)
            return "".join(text)
        import openai

        client = openai.AsyncOpenAI(api_key="x", base_url="http://walk/v1", http_client=http)
        if route == "responses":
            # NOTE: Responses' least budget is 16, as OpenAI's
            rstream = await client.responses.create(model=model, stream=True, temperature=0,
                                                    max_output_tokens=max(max_tokens, 16),
                                                    input="Say hello.")
            async for ev in rstream:
                if ev.type == "response.output_text.delta":
                    text.append(ev.delta)
            return "".join(text)
        stream = await client.chat.completions.create(
            model=model, stream=True, max_tokens=max_tokens, temperature=0,
            messages=say)  # type: ignore[arg-type]
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
        return "".join(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the embedded model)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--route", choices=ROUTES, default="openai",
                    help="the protocol to walk: chat completions (default), Messages, "
                         "Responses, Ollama chat or generate")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    walk = Walk()
    threading.setprofile(walk.profile)  # NOTE: before the engine and worker threads start
    sys.setprofile(walk.profile)
    engine = AsyncEngine.from_model_dir(args.model, EngineConfig(max_num_seqs=4))
    engine.start()
    assert engine._thread is not None
    walk.engine_thread = engine._thread.ident
    warm = engine.grammar_warmup
    if warm is not None:  # NOTE: its build thread (grammar, tokenizer) is not the request's
        warm.release()
        warm.join()
    app = create_app(engine, manage_engine=False)
    try:
        # NOTE: warm-up: imports, caches, worker threads
        asyncio.run(drive(app, args.max_tokens, args.route))
        walk.active = walk.admitting = True
        text = asyncio.run(drive(app, args.max_tokens, args.route))
        walk.active = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        engine.shutdown()
    sites, names = budget_sites(ROOT)
    result = {
        "route": args.route,
        "text": text,
        "files": len(walk.files),
        "background_files": sorted(walk.background_files),
        "classes": len(walk.classes),
        "instances": sum(walk.classes.values()),
        "admission_classes": len(walk.admission_classes),
        "admission_instances": sum(walk.admission_classes.values()),
        "admission_stops": len(walk.path),
        "admission_modules": len(set(walk.path)),
        "admission_reentries": reentries(walk.path),
        "body_path_stops": len(walk.body_path),
        "body_path_modules": len(set(walk.body_path)),
        "body_path_reentries": reentries(walk.body_path),
        "body_path_call_reentries": len(call_reentries(walk.body_path, walk.body_calls)),
        "classes_made_once": sum(c <= 2 for c in walk.classes.values()),
        "classes_made_per_token": sum(c >= args.max_tokens for c in walk.classes.values()),
        "max_tokens_sites": len(sites),
        "max_tokens_names": dict(names),
        "max_tokens_by_layer": by_layer(sites),
    }
    print(json.dumps(result, indent=1))
    print("\nfiles:", *sorted(walk.files), sep="\n  ")
    print("\nclasses (instances):",
          *(f"{n} x{c}" for n, c in sorted(walk.classes.items())), sep="\n  ")
    print("\nadmission classes:", *sorted(walk.admission_classes), sep="\n  ")
    print("\nadmission path:", " -> ".join(p.removeprefix("coda.") for p in walk.path))
    print("\nbody path:", " -> ".join(p.removeprefix("coda.") for p in walk.body_path))
    print("\nbody path, call re-entries:",
          *call_reentries(walk.body_path, walk.body_calls), sep="\n  ")
    print("\nmax_tokens sites:", *sites, sep="\n  ")
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "files_list": sorted(walk.files),
                                               "classes_list": dict(walk.classes),
                                               "path": walk.path, "body_path": walk.body_path,
                                               "body_calls": walk.body_calls,
                                               "sites": sites}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
