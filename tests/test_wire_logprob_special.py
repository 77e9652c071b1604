"""Logprob entries reassemble the returned text exactly (SPEC K2, P1): a special token the
request skips (``skip_special_tokens``, the default) adds no text, so its chat / Responses /
Ollama entry has no bytes (``token: ""``, ``bytes: []``); with ``skip_special_tokens: false``
it is in the text and in its entry. The legacy completions arrays keep its text (their
``text_offset`` does not move: tests/test_server_openai.py).

A scripted default model (tests/wire_support.py) writes ``x``, ``<|im_start|>`` (special),
`` me`` and EOS, on every protocol the same tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.server.logprobs import chat_entries
from coda.stream import TokenInfo
from tests.wire_support import EOS_ID, X_ID, ScriptedServer, scripted_server

IM_START, ME = 1, 446  # "<|im_start|>" (special), " me" (default model)
SCRIPT = {X_ID: IM_START, IM_START: ME, ME: EOS_ID}
SKIPPED, KEPT = "x me", "x<|im_start|> me"
MSG: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv() -> Iterator[ScriptedServer]:
    yield from scripted_server(SCRIPT)


def _oai(server: ScriptedServer) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    return client, client.models.list().data[0].id


def _joined(entries: list[Any]) -> tuple[bytes, str]:
    return (b"".join(bytes(e.bytes) for e in entries), "".join(e.token for e in entries))


@pytest.mark.parametrize(("skip", "text"), [(True, SKIPPED), (False, KEPT)])
def test_k2_chat_logprob_bytes_reassemble_the_text_around_a_skipped_special(
        srv: ScriptedServer, skip: bool, text: str) -> None:
    """K2: whole and streamed, the entries' bytes and tokens are the content, the special
    token's entry empty where it is skipped; its logprob still stands."""
    client, model = _oai(srv)
    extra = {"skip_special_tokens": skip}
    whole = client.chat.completions.create(model=model, messages=MSG, logprobs=True,
                                           top_logprobs=1, extra_body=extra)
    entries = whole.choices[0].logprobs.content
    assert whole.choices[0].message.content == text
    assert _joined(entries) == (text.encode(), text)
    assert [e.token for e in entries] == ["x", "" if skip else "<|im_start|>", " me"]
    assert all(e.logprob is not None for e in entries)
    streamed = [e for ch in client.chat.completions.create(
        model=model, messages=MSG, logprobs=True, stream=True, extra_body=extra)
        for c in ch.choices if c.logprobs and c.logprobs.content for e in c.logprobs.content]
    assert _joined(streamed) == (text.encode(), text)


@pytest.mark.parametrize(("skip", "text"), [(True, SKIPPED), (False, KEPT)])
def test_k2_responses_logprob_bytes_reassemble_the_text(srv: ScriptedServer, skip: bool,
                                                        text: str) -> None:
    """K2 on Responses: the final ``output_text`` logprobs and the deltas' alike."""
    client, model = _oai(srv)
    kw: dict[str, Any] = dict(model=model, input="hi", top_logprobs=1,
                              include=["message.output_text.logprobs"],
                              extra_body={"skip_special_tokens": skip})
    whole = client.responses.create(**kw)
    assert whole.output_text == text
    assert _joined(whole.output[0].content[0].logprobs) == (text.encode(), text)
    deltas = [e for ev in client.responses.create(stream=True, **kw)
              if ev.type == "response.output_text.delta" for e in ev.logprobs]
    assert _joined(deltas) == (text.encode(), text)


@pytest.mark.parametrize(("skip", "text"), [(True, SKIPPED), (False, KEPT)])
def test_k2_ollama_logprob_bytes_reassemble_the_text(srv: ScriptedServer, skip: bool,
                                                     text: str) -> None:
    """K2 on Ollama ``/api/chat``: the whole answer's logprobs and the lines' alike."""
    model = _oai(srv)[1]
    body = {"model": model, "messages": MSG, "logprobs": True, "skip_special_tokens": skip}
    whole = httpx.post(srv.url + "/api/chat", json={**body, "stream": False}).json()
    assert whole["message"]["content"] == text
    assert b"".join(bytes(e["bytes"]) for e in whole["logprobs"]) == text.encode()
    with httpx.stream("POST", srv.url + "/api/chat", json=body) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert b"".join(bytes(e["bytes"]) for ln in lines for e in ln.get("logprobs") or []) \
        == text.encode()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("include", "text"), [(False, "x m"), (True, "x me")])
def test_s3_k2_a_stop_inside_a_token_cuts_its_logprob_bytes(srv: ScriptedServer, stream: bool,
                                                            include: bool, text: str) -> None:
    """S3, K2: stop ``"e"`` ends the text inside the token `` me``: its entry keeps the part
    before the stop (`` m``), so the entries' bytes are the text (chat, Responses, legacy)."""
    client, model = _oai(srv)
    extra = {"include_stop_str_in_output": include}
    if stream:
        chunks = list(client.chat.completions.create(
            model=model, messages=MSG, logprobs=True, stop=["e"], stream=True,
            extra_body=extra))
        got = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
        entries = [e for ch in chunks for c in ch.choices
                   if c.logprobs and c.logprobs.content for e in c.logprobs.content]
    else:
        whole = client.chat.completions.create(model=model, messages=MSG, logprobs=True,
                                               stop=["e"], extra_body=extra)
        got, entries = whole.choices[0].message.content, whole.choices[0].logprobs.content
    assert got == text and _joined(entries) == (text.encode(), text)
    legacy = client.completions.create(model=model, prompt="hi", logprobs=0, stop=["e"],
                                       stream=stream, extra_body=extra)
    parts = list(legacy) if stream else [legacy]
    # NOTE: the legacy tokens keep a skipped special's text (its text_offset does not move)
    assert "".join(t for p in parts for c in p.choices
                   for t in (c.logprobs.tokens if c.logprobs else [])) == text.replace(
        "x", "x<|im_start|>", 1)
    resp = client.responses.create(model=model, input="hi", top_logprobs=0,
                                   include=["message.output_text.logprobs"],
                                   extra_body={"stop": ["e"], **extra})
    assert resp.output_text == text
    assert _joined(resp.output[0].content[0].logprobs) == (text.encode(), text)


_TOKENS = st.lists(st.tuples(st.binary(max_size=4), st.booleans()), max_size=12)


@settings(deadline=None)
@given(_TOKENS, st.booleans())
def test_k2_chat_entries_bytes_are_the_text_for_all_tokens(
        tokens: list[tuple[bytes, bool]], skip: bool) -> None:
    """For all token pieces and special flags: the entries' bytes are exactly the kept
    pieces (a skipped special's none), one entry per token."""
    infos = [TokenInfo(i, -0.5, piece=p, special=s) for i, (p, s) in enumerate(tokens)]
    entries = chat_entries(infos, skip_special=skip)
    assert len(entries) == len(tokens)
    assert b"".join(bytes(e["bytes"]) for e in entries) == b"".join(
        p for p, s in tokens if not (skip and s))
    assert [e["logprob"] for e in entries] == [-0.5] * len(tokens)
