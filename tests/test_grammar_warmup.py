"""The grammar tokenizer is built off the request path (the API-gaps issue item 2; SPEC G1,
S1): llguidance's tokenizer — seconds on Gemma 3's 262k vocabulary — is built once, on a
thread the engine starts once the model is loaded; the first structured-output request, sent
through the official ``openai`` client over loopback, never builds it itself (it waits for the
build when it comes first) and its output is as valid as ever.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from coda.engine import grammar

SCHEMA = {"type": "object", "required": ["zone"], "additionalProperties": False,
          "properties": {"zone": {"enum": ["UTC", "CET"]}}}
FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "z", "schema": SCHEMA}}


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[str], threading.Event]]:
    """Each llguidance tokenizer build (the thread it ran on), held until the gate opens, so
    a request sent right after the start surely arrives while it runs."""
    real = grammar._build_ll_tokenizer
    seen: list[str] = []
    gate = threading.Event()

    def held(tokenizer: Any, eos: Any) -> Any:
        gate.wait(120)
        seen.append(threading.current_thread().name)
        return real(tokenizer, eos)

    monkeypatch.setattr(grammar, "_build_ll_tokenizer", held)
    yield seen, gate
    gate.set()


def test_g1_first_grammar_request_waits_for_the_background_build_never_builds(
        builds: tuple[list[str], threading.Event], caplog: pytest.LogCaptureFixture) -> None:
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
        assert seen == ["coda-grammar-tokenizer"]
        done = [r for r in caplog.records if r.getMessage() == "grammar tokenizer built"]
        assert len(done) == 1 and getattr(done[0], "grammar_tokenizer_s", 0) >= 0.5
        assert getattr(done[0], "model", None) == engine.model_name
    finally:
        gate.set()
        server.stop()
        engine.shutdown()


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
