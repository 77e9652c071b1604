"""The grammar tokenizer is built off the request path (the API-gaps issue item 2, issue 19
item 2; SPEC G1, S1): llguidance's tokenizer — seconds on Gemma 3's 262k vocabulary, the GIL
held throughout — is built once, on a thread the engine prepares once the model is loaded and
that starts building only after the server answered its first request (so ``/health`` never
waits for it), when a grammar request asks for it, or after the hold; the first
structured-output request, sent through the official ``openai`` client over loopback, never
builds it itself (it waits for the build when it comes first) and its output is as valid as
ever.
"""

from __future__ import annotations

import json
import logging
import threading
import types
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from coda.engine import grammar_tokenizer as grammar


class _Seen(list[str]):
    """The threads that built, and whether a build has begun."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.fake: object | None = None  # NOTE: returned instead of building, where set


SCHEMA = {"type": "object", "required": ["zone"], "additionalProperties": False,
          "properties": {"zone": {"enum": ["UTC", "CET"]}}}
FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "z", "schema": SCHEMA}}


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[_Seen, threading.Event]]:
    """Each llguidance tokenizer build (the thread it ran on), held until the gate opens, so
    a request sent right after the start surely arrives while it runs; ``entered`` (the
    fixture's ``seen.entered``) says when a build began. The hold before a released build is
    an hour here: only a release (or a grammar request) starts it."""
    real = grammar._build_ll_tokenizer
    seen = _Seen()
    gate = threading.Event()
    monkeypatch.setattr(grammar, "WARMUP_HOLD_S", 3600.0)

    def held(tokenizer: Any, eos: Any) -> Any:
        seen.entered.set()
        gate.wait(120)
        seen.append(threading.current_thread().name)
        return seen.fake if seen.fake is not None else real(tokenizer, eos)

    monkeypatch.setattr(grammar, "_build_ll_tokenizer", held)
    yield seen, gate
    gate.set()


def test_g1_first_grammar_request_waits_for_the_background_build_never_builds(
        builds: tuple[_Seen, threading.Event], caplog: pytest.LogCaptureFixture) -> None:
    """G1/S1: the engine's start builds the tokenizer on ``coda-grammar-tokenizer`` (once, its
    time logged as ``grammar tokenizer built``); a json_schema request arriving mid-build
    waits for it and answers schema-valid JSON; a second request builds nothing either."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app
    from tests.conftest import LiveServer

    seen, gate = builds
    engine = AsyncEngine.from_model_dir(None, EngineConfig(max_num_seqs=2))
    caplog.set_level(logging.INFO, logger="coda.engine.grammar")
    engine.start()
    server = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        # NOTE: issue 19 item 2: held until the first answer (no build began before it)
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert seen.entered.wait(30)  # NOTE: released by that answer, not the hour's hold
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
        model = oa.models.list().data[0].id
        assert engine.grammar_warmup is not None and engine.grammar_warmup.is_alive()
        answers: list[str] = []

        def ask() -> None:
            r = oa.chat.completions.create(
                model=model, max_tokens=24, seed=1, response_format=FORMAT,
                messages=[{"role": "user", "content": "Which zone?"}])
            answers.append(r.choices[0].message.content or "")

        first = threading.Thread(target=ask)
        first.start()
        first.join(0.5)
        assert first.is_alive() and not answers  # NOTE: waiting for the build, not building
        gate.set()
        first.join(120)
        ask()
        assert [json.loads(a)["zone"] in ("UTC", "CET") for a in answers] == [True, True]
        assert list(seen) == ["coda-grammar-tokenizer"]
        done = [r for r in caplog.records if r.getMessage() == "grammar tokenizer built"]
        assert len(done) == 1 and getattr(done[0], "grammar_tokenizer_s", 0) >= 0.5
        assert getattr(done[0], "model", None) == engine.model_name
    finally:
        gate.set()
        server.stop()
        engine.shutdown()


def test_s1_health_is_answered_before_the_build_begins(
        builds: tuple[_Seen, threading.Event], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19 item 2: the engine's start only prepares the build and the server defers it;
    ``/health`` (the first request) is answered without it — the build holds the GIL, so
    anything it overlaps waits — and it begins once the server has been idle for
    ``WARMUP_IDLE_S`` after that answer, not sooner."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server import app as app_module
    from tests.conftest import LiveServer

    monkeypatch.setattr(app_module, "WARMUP_IDLE_S", 1.5)
    seen, gate = builds
    engine = AsyncEngine.from_model_dir(None, EngineConfig(max_num_seqs=2))
    engine.start()
    server = LiveServer(app_module.create_app(engine, manage_engine=False)).start()
    try:
        warm = engine.grammar_warmup
        assert warm is not None and warm.deferred and not warm.released
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert not seen.entered.wait(0.5)  # NOTE: idle for less than 1.5 s yet
        assert seen.entered.wait(30) and warm.released
    finally:
        gate.set()
        server.stop()
        engine.shutdown()


def test_g1_a_grammar_request_starts_a_held_build_on_its_thread(
        builds: tuple[_Seen, threading.Event]) -> None:
    """G1/S1: with no server to release it, the first :func:`grammar.ll_tokenizer` call starts
    the prepared build at once (not after the hold) and waits for it: it is built on
    ``coda-grammar-tokenizer``, never on the caller's thread, and only once."""
    seen, gate = builds
    seen.fake = types.SimpleNamespace(vocab_size=0)
    tok: Any = type("T", (), {})()  # NOTE: any weak-referenceable key
    warm = grammar.warm_ll_tokenizer(tok, frozenset({0}), "m")
    got: list[Any] = []
    asker = threading.Thread(target=lambda: got.append(grammar.ll_tokenizer(tok, frozenset({0}))))
    asker.start()
    assert seen.entered.wait(30)  # NOTE: the hour's hold did not apply
    asker.join(0.3)
    assert asker.is_alive() and not got  # NOTE: waiting for the warm-up's build
    gate.set()
    asker.join(30)
    warm.join(30)
    assert list(seen) == ["coda-grammar-tokenizer"] and got == [seen.fake]


def test_g1_a_held_build_starts_after_its_hold(builds: tuple[_Seen, threading.Event]) -> None:
    """Nobody released it and nobody asked: the build begins once the hold has passed."""
    seen, gate = builds
    seen.fake = types.SimpleNamespace(vocab_size=0)
    tok: Any = type("T", (), {})()
    warm = grammar.warm_ll_tokenizer(tok, frozenset({0}), "m", hold_s=0.2)
    assert not seen.entered.wait(0.05) and not warm.released
    assert seen.entered.wait(30) and warm.released
    gate.set()
    warm.join(30)


def test_g1_a_deferred_build_waits_past_its_hold_for_the_release(
        builds: tuple[_Seen, threading.Event]) -> None:
    """A deferred build (a server's) ignores the hold's end: only the release starts it."""
    seen, gate = builds
    seen.fake = types.SimpleNamespace(vocab_size=0)
    tok: Any = type("T", (), {})()
    warm = grammar.warm_ll_tokenizer(tok, frozenset({0}), "m", hold_s=0.2)
    warm.defer()
    assert not seen.entered.wait(0.6) and not warm.released
    warm.release()
    assert seen.entered.wait(30)
    gate.set()
    warm.join(30)


def test_g1_a_tokenizer_llguidance_refuses_is_said_by_the_request(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A build that fails in the background is logged, not raised, and nothing is cached:
    the grammar request then builds again and reports the failure itself (as before)."""
    calls: list[str] = []

    def refuse(tokenizer: Any, eos: Any) -> Any:
        calls.append(threading.current_thread().name)
        raise ValueError("can't determine decoder type")

    monkeypatch.setattr(grammar, "_build_ll_tokenizer", refuse)
    caplog.set_level(logging.INFO, logger="coda.engine.grammar")
    tok: Any = type("T", (), {})()  # NOTE: any weak-referenceable key
    grammar.warm_ll_tokenizer(tok, frozenset({0}), "m").join(10)
    assert calls == ["coda-grammar-tokenizer"]
    assert any(r.getMessage() == "grammar tokenizer not built" for r in caplog.records)
    with pytest.raises(ValueError, match="decoder type"):
        grammar.ll_tokenizer(tok, frozenset({0}))
    assert len(calls) == 2
