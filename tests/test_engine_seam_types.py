"""Issue 22: no ``Any`` at the server–engine seam (L1, P1–P3: what crosses it is typed plain
data). The seam's modules name no ``Any``; every engine the server may hold (in process, or
the several-models router) types the :class:`~coda.engine.protocol.Engine` members it
implements; the server's own calls into the engine take it typed. ``mypy --strict`` checks
these modules (pyproject's list), so a typed member that lies fails there too.
"""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path
from typing import Any

import pytest

from coda.engine.async_engine import AsyncEngine
from coda.engine.protocol import Engine, EngineHandle, ModelSelecting
from coda.server.chat import render_chat
from coda.server.model_dispatch import RoutedHandle
from coda.server.model_router import ModelRouter
from coda.server.state import ServerState, split_reasoning

ROOT = Path(__file__).resolve().parent.parent
SEAM = ("coda/engine/protocol.py", "coda/engine/async_engine.py",
        "coda/engine/types.py", "coda/stream.py")


@pytest.mark.parametrize("path", SEAM)
def test_issue22_the_seam_modules_name_no_any(path: str) -> None:
    """Issue 22: the seam's modules (the protocol, the handle, ``submit``, the request and
    event types) never name ``typing.Any``."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "Any" not in names


def _members(proto: type) -> list[str]:
    return sorted(n for n in {*proto.__annotations__, *vars(proto)}
                  if not n.startswith("_") and n not in ("mro",))


def _hints(cls: type, name: str) -> str:
    """The annotation of ``cls.name``: a property's return, a method's signature, or the
    class attribute's declared type (as text, resolved where it can be)."""
    attr = inspect.getattr_static(cls, name, None)
    if isinstance(attr, property) and attr.fget is not None:
        return repr(typing.get_type_hints(attr.fget).get("return"))
    if callable(attr):
        return repr(typing.get_type_hints(attr))
    for base in cls.__mro__:
        ann = vars(base).get("__annotations__", {})
        if name in ann:
            return str(ann[name])
    return ""


@pytest.mark.parametrize("cls", [AsyncEngine, ModelRouter], ids=lambda c: c.__name__)
def test_issue22_every_engine_types_the_protocol_members_without_any(cls: type) -> None:
    """Issue 22: each ``Engine`` member an implementation declares (tokenizer, chat template,
    submit, attach, cancel, stats, model info...) has a type, and it is not ``Any``."""
    for name in _members(Engine):
        hint = _hints(cls, name)
        assert "Any" not in hint, (cls.__name__, name, hint)


def test_issue22_the_routed_handle_and_the_servers_calls_are_typed() -> None:
    """Issue 22: the router's handle types its fields (the lock included); the server renders
    with an ``Engine``, splits reasoning with a tokenizer and routes a call by name through the
    typed ``ModelSelecting`` capability (the router has it, the in-process engine does not)."""
    handle_hints: dict[str, Any] = typing.get_type_hints(RoutedHandle)
    assert not [n for n, t in handle_hints.items() if t is Any]
    assert set(_members(EngineHandle)) <= set(handle_hints) | set(dir(RoutedHandle))
    assert "Engine" in str(inspect.signature(render_chat).parameters["engine"].annotation)
    assert "Tokenizer" in str(inspect.signature(split_reasoning).parameters["tokenizer"]
                              .annotation)
    assert all(hasattr(ModelRouter, n) for n in ("select_model", "served_names"))
    assert not all(hasattr(AsyncEngine, n) for n in ("select_model", "served_names"))
    assert "ModelSelecting" in inspect.getsource(ServerState.check_model)
    assert isinstance(ModelSelecting, type)
