"""K2, S2, S3 on the wire: a stop string that STARTS inside a token whose first bytes were
already sent. The scripted default model (tests/wire_support.py) writes ``x``, ``"\\n "``
(one token) and `` me``; with stop ``"  m"`` the ``"\\n"`` goes out while the space waits as a
possible stop start (S2), then `` me`` completes the stop: the text is ``"x\\n"``. The token
``"\\n "`` must not be reported with the ``"\\n"`` delta as ``"\\n "`` (bytes the text never
gets): its entry waits for its last byte and, cut to ``"\\n"``, comes with the final chunk.
Official ``openai`` client: chat and legacy completions, whole and streamed; Responses;
Ollama ``/api/chat``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.wire_support import EOS_ID, X_ID, ScriptedServer, scripted_server

NL_SP, ME = 2537, 446  # "\n " and " me" (default model)
SCRIPT = {X_ID: NL_SP, NL_SP: ME, ME: EOS_ID}
STOP, TEXT = ["  m"], "x\n"
MSG: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv() -> Iterator[ScriptedServer]:
    yield from scripted_server(SCRIPT)


def _oai(server: ScriptedServer) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    return client, client.models.list().data[0].id


def _joined(entries: list[Any]) -> bytes:
    return b"".join(bytes(e.bytes) for e in entries)


def test_the_script_writes_the_straddling_token() -> None:
    """The fixture's premise: ``"\\n "`` is one token of the default model."""
    import tokenizers

    from coda.detokenizer import profile_of
    from coda.engine.async_engine import DEFAULT_MODEL_DIR

    tok = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    assert (profile_of(tok).piece(NL_SP), profile_of(tok).piece(ME)) == (b"\n ", b" me")


@pytest.mark.parametrize("stream", [False, True])
def test_k2_s3_chat_entries_are_the_text_when_a_stop_starts_inside_a_sent_token(
        srv: ScriptedServer, stream: bool) -> None:
    """K2, S3: chat, whole and streamed: the entries' bytes are ``"x\\n"`` (the straddling
    token's entry cut to ``"\\n"``), never ``"x\\n "``; streamed, no chunk's entries run past
    the text received so far (S2: the ``"\\n"`` still went out before the stop was known)."""
    client, model = _oai(srv)
    if stream:
        chunks = list(client.chat.completions.create(
            model=model, messages=MSG, logprobs=True, stop=STOP, stream=True))
        got, entries, seen = "", [], []
        for ch in chunks:
            for c in ch.choices:
                got += c.delta.content or ""
                if c.logprobs and c.logprobs.content:
                    entries += c.logprobs.content
                seen.append((len(got.encode()), len(_joined(entries))))
        assert all(n_entries <= n_text for n_text, n_entries in seen)
    else:
        whole = client.chat.completions.create(model=model, messages=MSG, logprobs=True,
                                               stop=STOP)
        got, entries = whole.choices[0].message.content, whole.choices[0].logprobs.content
        assert whole.choices[0].finish_reason == "stop"
    assert got == TEXT
    assert _joined(entries) == TEXT.encode()
    assert [e.token for e in entries] == ["x", "\n"]


@pytest.mark.parametrize("stream", [False, True])
def test_k2_s3_legacy_responses_ollama_entries_are_the_text(srv: ScriptedServer,
                                                            stream: bool) -> None:
    """K2, S3 on the other logprob renderers: legacy completions' tokens, Responses'
    ``output_text`` logprobs and Ollama's all reassemble ``"x\\n"``."""
    client, model = _oai(srv)
    legacy = client.completions.create(model=model, prompt="hi", logprobs=0, stop=STOP,
                                       stream=stream)
    parts = list(legacy) if stream else [legacy]
    assert "".join(c.text for p in parts for c in p.choices) == TEXT
    assert "".join(t for p in parts for c in p.choices
                   for t in (c.logprobs.tokens if c.logprobs else [])) == TEXT
    kw: dict[str, Any] = dict(model=model, input="hi", top_logprobs=0,
                              include=["message.output_text.logprobs"],
                              extra_body={"stop": STOP})
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        done = [ev.response for ev in events if ev.type == "response.completed"][0]
        deltas = [e for ev in events if ev.type == "response.output_text.delta"
                  for e in ev.logprobs]
        assert done.output_text == TEXT
        assert _joined(done.output[0].content[0].logprobs) == TEXT.encode()
        assert len(_joined(deltas)) <= len(TEXT.encode())
    else:
        resp = client.responses.create(**kw)
        assert resp.output_text == TEXT
        assert _joined(resp.output[0].content[0].logprobs) == TEXT.encode()
    body = {"model": model, "messages": MSG, "logprobs": True, "options": {"stop": STOP},
            "stream": stream}
    if stream:
        with httpx.stream("POST", srv.url + "/api/chat", json=body) as r:
            lines = [json.loads(line) for line in r.iter_lines() if line]
        content = "".join(ln["message"]["content"] for ln in lines)
        got = b"".join(bytes(e["bytes"]) for ln in lines for e in ln.get("logprobs") or [])
    else:
        whole = httpx.post(srv.url + "/api/chat", json=body).json()
        content = whole["message"]["content"]
        got = b"".join(bytes(e["bytes"]) for e in whole["logprobs"])
    assert content == TEXT and got == TEXT.encode()

