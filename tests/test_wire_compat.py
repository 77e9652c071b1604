"""What the upstream APIs accept is accepted by Coda and means what it means there (SPEC P1,
L4). Found by the third black-box acceptance sweep (sweep3), through the official clients on
SmolLM2 Q4_1 and Gemma 3 270M:

- Ollama ``options.num_predict: -1`` / ``-2`` ("no limit but the context's", docs/api.md)
  ended at ``EngineConfig.default_max_tokens`` (256 tokens, ``length``), as if unset.
- OpenAI ``stream_options.include_obfuscation`` (a field of the official SDK's chat,
  completions and Responses stream options) was a 400 "Unrecognized request argument"; the
  Responses API had no ``stream_options`` at all.
- An Ollama body sent as Ollama's README sends it (``curl -d``: a form content type, or
  none of JSON) was a 400 "request body must be a JSON object"; Ollama reads any body as JSON.
- ``HEAD`` on a GET route (``/``, ``/health``, ``/api/tags``, ``/api/version``,
  ``/v1/models``) was a 405: Ollama's CLI checks its server with ``HEAD /`` first.
- Ollama ``logprobs`` / ``top_logprobs`` (arguments of the official client's ``chat`` and
  ``generate``) were a 400 "Unrecognized request argument".
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama
import openai
import pytest

MODEL = "tiny-chat"
CONTEXT = 512  # NOTE: the server fixture's context (tests/conftest.py: server_checkpoint)
DEFAULT_MAX = 32  # NOTE: its EngineConfig.default_max_tokens


class _IgnoreEos(httpx.HTTPTransport):
    """Adds Coda's ``ignore_eos`` extension to the official Ollama client's body (it has no
    such argument), so only a budget can end the output."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        content = json.dumps({**json.loads(request.content), "ignore_eos": True}).encode()
        request = httpx.Request(request.method, request.url, content=content,
                                headers={**request.headers, "content-length": str(len(content))})
        return super().handle_request(request)


@pytest.mark.parametrize("num_predict", [-1, -2])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "generate"])
def test_l4_ollama_num_predict_unlimited_runs_to_the_context(
        server_live: Any, num_predict: int, chat: bool) -> None:
    """SPEC L4: ``num_predict`` -1 / -2 asks for no limit but the context's: with EOS ignored
    the output fills the context (prompt + output == the context), ``done_reason`` ``length``;
    it stopped at the server's default budget, the reading of an unset ``num_predict``."""
    c = ollama.Client(host=server_live.url, transport=_IgnoreEos())
    options = {"num_predict": num_predict, "temperature": 0}
    r: Any = (c.chat(model=MODEL, messages=[{"role": "user", "content": "q"}], options=options)
              if chat else c.generate(model=MODEL, prompt="q", options=options))
    assert r.done_reason == "length" and r.eval_count > DEFAULT_MAX, r
    # NOTE: the client drops ``coda``; the raw answer says how many prompt tokens there were
    body = ({"messages": [{"role": "user", "content": "q"}]} if chat else {"prompt": "q"}) | {
        "model": MODEL, "stream": False, "options": options, "ignore_eos": True}
    raw = httpx.post(server_live.url + ("/api/chat" if chat else "/api/generate"), json=body,
                     timeout=120).json()
    assert raw["coda"]["usage"]["prompt_tokens"] + raw["eval_count"] == CONTEXT, raw["coda"]
    # NOTE: the context ended it, no limit of the client's (it read max_output_tokens)
    assert raw["coda"]["finish_reason"] == "context_limit", raw["coda"]


def test_l4_ollama_num_predict_unset_runs_to_the_context(server_live: Any) -> None:
    """SPEC L4: an unset ``num_predict`` is Ollama's -1, no limit but the context (not the
    server's default budget, docs/api.md): with EOS ignored the answer fills the context and
    ends ``length``, Coda's ``context_limit`` (the finish reason the ``coda`` extension and
    the trace carry; it was ``max_output_tokens``, as if the client had set a limit), whole
    and streamed."""
    r = ollama.Client(host=server_live.url, transport=_IgnoreEos()).generate(
        model=MODEL, prompt="q", options={"temperature": 0})
    assert r.eval_count > DEFAULT_MAX, r
    assert r.done_reason == "length" and r.prompt_eval_count + r.eval_count == CONTEXT, r
    body = {"model": MODEL, "prompt": "q", "ignore_eos": True, "options": {"temperature": 0}}
    raw = httpx.post(server_live.url + "/api/generate", json=body | {"stream": False},
                     timeout=120).json()
    assert raw["coda"]["finish_reason"] == "context_limit", raw["coda"]
    with httpx.stream("POST", server_live.url + "/api/generate", json=body,
                      timeout=120) as resp:
        last = json.loads([line for line in resp.iter_lines() if line][-1])
    assert last["done_reason"] == "length", last
    assert last["coda"]["finish_reason"] == "context_limit", last["coda"]


def test_l4_openai_chat_without_max_tokens_ends_honestly(server_live: Any) -> None:
    """SPEC L4 (docs/api.md): an omitted ``max_tokens`` on chat is the server's default
    budget: a prompt with room past it ends ``max_output_tokens`` after that many tokens; a
    prompt that leaves less room than the default runs to the context and ends
    ``context_limit`` (both OpenAI's ``length``)."""
    client = _openai(server_live)
    kw: Any = {"model": MODEL, "temperature": 0, "extra_body": {"ignore_eos": True}}
    short = client.chat.completions.create(messages=[{"role": "user", "content": "q"}], **kw)
    ext: Any = short.choices[0].model_extra["coda"]  # type: ignore[index]
    assert short.choices[0].finish_reason == "length"
    assert ext["finish_reason"] == "max_output_tokens", ext
    assert short.usage is not None and short.usage.completion_tokens == DEFAULT_MAX
    room = DEFAULT_MAX // 2
    long = "a" * (CONTEXT - short.usage.prompt_tokens - room)  # NOTE: a token a character
    full = client.chat.completions.create(messages=[{"role": "user", "content": "q" + long}],
                                          **kw)
    ext = full.choices[0].model_extra["coda"]  # type: ignore[index]
    assert full.choices[0].finish_reason == "length"
    assert ext["finish_reason"] == "context_limit", ext
    assert full.usage is not None
    assert full.usage.prompt_tokens + full.usage.completion_tokens == CONTEXT
    assert full.usage.completion_tokens < DEFAULT_MAX


def _openai(live: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0)


@pytest.mark.parametrize("obfuscation", [False, True])
def test_p1_stream_options_include_obfuscation_is_accepted(
        server_live: Any, obfuscation: bool) -> None:
    """SPEC P1: ``include_obfuscation`` (either value) is accepted on chat, completions and
    Responses streams, with no effect on what is streamed (docs/api.md: no padding), and
    ``include_usage`` beside it still works."""
    c = _openai(server_live)
    q = [{"role": "user", "content": "q"}]
    kw: Any = {"model": MODEL, "temperature": 0, "stream": True}
    chat = list(c.chat.completions.create(messages=q, max_tokens=4, **kw, stream_options={
        "include_usage": True, "include_obfuscation": obfuscation}))
    assert chat[-1].usage is not None and chat[-1].usage.completion_tokens == 4
    assert all("obfuscation" not in (k.model_extra or {}) for k in chat)
    plain = list(c.chat.completions.create(messages=q, max_tokens=4, **kw))
    assert ([k.choices[0].delta.content for k in chat if k.choices]
            == [k.choices[0].delta.content for k in plain if k.choices])
    text = list(c.completions.create(prompt="q", max_tokens=4, **kw, stream_options={
        "include_obfuscation": obfuscation}))
    assert text[-1].choices[0].finish_reason == "length"
    events = list(c.responses.create(input="q", max_output_tokens=16, **kw, stream_options={
        "include_obfuscation": obfuscation}))
    assert [e.type for e in events][-1] == "response.incomplete"


def test_p1_responses_stream_options_need_a_stream(server_live: Any) -> None:
    """SPEC P1: as chat's, Responses ``stream_options`` without ``stream`` is a 400 naming
    it, never ignored."""
    with pytest.raises(openai.BadRequestError) as e:
        _openai(server_live).responses.create(model=MODEL, input="q", max_output_tokens=16,
                                              stream_options={"include_obfuscation": False})
    assert e.value.body["param"] == "stream_options", e.value.body  # type: ignore[index]


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/api/show", "/api/embed"])
def test_p1_ollama_reads_the_body_as_json_whatever_its_content_type(
        server_live: Any, path: str, content_type: str) -> None:
    """SPEC P1: as Ollama, an ``/api/`` body is JSON whatever its ``Content-Type`` (its
    README's ``curl -d``); a body that is not JSON is still a 400 in Ollama's shape."""
    body = {"model": MODEL, "stream": False, "options": {"num_predict": 2}} | {
        "/api/generate": {"prompt": "q"}, "/api/chat": {"messages": [{"role": "user",
                                                                      "content": "q"}]},
        "/api/show": {}, "/api/embed": {"input": "q"}}[path]
    if path in ("/api/show", "/api/embed"):
        del body["stream"]
    headers = {"content-type": content_type}
    r = httpx.post(server_live.url + path, content=json.dumps(body), headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    bad = httpx.post(server_live.url + path, content=b"model=x", headers=headers, timeout=60)
    assert bad.status_code == 400 and isinstance(bad.json()["error"], str), bad.text



@pytest.mark.parametrize("path", ["/", "/health", "/metrics", "/v1/models",
                                  f"/v1/models/{MODEL}", "/api/tags", "/api/ps",
                                  "/api/version", "/favicon.ico"])
def test_p1_head_is_a_get_without_the_body(server_live: Any, path: str) -> None:
    """SPEC P1: ``HEAD`` answers as ``GET`` does (status, content type), with no body
    (RFC 9110): Ollama's own server answers ``HEAD /`` and its CLI asks it first."""
    get = httpx.get(server_live.url + path, timeout=30)
    head = httpx.head(server_live.url + path, timeout=30)
    assert head.status_code == get.status_code == 200, (head.status_code, get.status_code)
    assert head.headers["content-type"] == get.headers["content-type"]
    assert head.content == b"" and get.content != b""


def test_p1_head_on_an_unknown_model_is_its_404(server_live: Any) -> None:
    """SPEC P1: a HEAD is the GET's answer, a 404 included."""
    assert httpx.head(server_live.url + "/v1/models/nope", timeout=30).status_code == 404


# NOTE: /v1/chat/completions is also the stored completions' list (a GET, so its HEAD is that
# answer): the POST-only routes are the others
@pytest.mark.parametrize("path", ["/v1/streams/x", "/v1/responses/x?stream=true",
                                  "/v1/completions", "/v1/messages", "/api/chat"])
def test_p3_no_head_on_streams_nor_post_routes(server_live: Any, path: str) -> None:
    """SPEC P3: a HEAD never attaches a reader to a stream (a resume route), and a POST-only
    route stays a 405."""
    assert httpx.head(server_live.url + path, timeout=30).status_code == 405


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "generate"])
def test_p1_ollama_logprobs_streamed_equal_whole(server_live: Any, chat: bool) -> None:
    """SPEC P1, P2, K2: Ollama ``logprobs`` with ``top_logprobs`` through the official client:
    one entry per output token (``eval_count``), the streamed lines' entries equal the whole
    answer's, every entry has ``top_logprobs`` k alternatives, and the entries' bytes are the
    text."""
    c = ollama.Client(host=server_live.url)
    kw: Any = {"model": MODEL, "logprobs": True, "top_logprobs": 3,
               "options": {"num_predict": 8, "temperature": 0.9, "seed": 5}}
    call: Any = (lambda **k: c.chat(messages=[{"role": "user", "content": "q"}], **kw, **k)
                 ) if chat else (lambda **k: c.generate(prompt="q", **kw, **k))
    whole = call(stream=False)
    lines = list(call(stream=True))
    text = whole.message.content if chat else whole.response
    streamed = [e for line in lines for e in (line.logprobs or [])]
    assert whole.logprobs is not None and len(whole.logprobs) == whole.eval_count
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, e.logprob) for e in whole.logprobs]
    assert all(len(e.top_logprobs or []) == 3 for e in whole.logprobs)
    raw = httpx.post(server_live.url + ("/api/chat" if chat else "/api/generate"), timeout=60,
                     json={**kw, "stream": False, **({"messages": [{"role": "user", "content": "q"}]}
                                                     if chat else {"prompt": "q"})}).json()
    assert b"".join(bytes(e["bytes"]) for e in raw["logprobs"]).decode() == text


def test_p1_ollama_without_logprobs_has_none(server_live: Any) -> None:
    """SPEC P1: no ``logprobs`` asked, none sent (streamed or not)."""
    c = ollama.Client(host=server_live.url)
    opts = {"num_predict": 4, "temperature": 0}
    assert c.generate(model=MODEL, prompt="q", options=opts).logprobs is None
    assert all(x.logprobs is None for x in c.generate(model=MODEL, prompt="q", options=opts,
                                                         stream=True))


def test_k2_ollama_logprobs_of_a_cut_character_are_streamed_too(
        smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """SPEC K2, K3: where the budget cuts a multi-byte character (its bytes are dropped, its
    tokens carry no text), the streamed lines still hold those tokens' logprobs, as the whole
    answer does: one entry per output token either way, and the entries' bytes are the text's."""
    entries: list[list[bytes]] = []
    for n in range(1, 10):
        kw: Any = {"model": smollm_name, "prompt": "Emoji: show me some emoji",
                   "logprobs": True, "options": {"num_predict": n, "temperature": 0}}
        whole = smollm_ollama.generate(**kw)
        streamed = [e for line in smollm_ollama.generate(**kw, stream=True)
                    for e in (line.logprobs or [])]
        assert whole.logprobs is not None and len(whole.logprobs) == whole.eval_count == n
        assert [(e.token, e.logprob) for e in streamed] == [
            (e.token, e.logprob) for e in whole.logprobs]
        raw = httpx.post(str(smollm_ollama._client.base_url) + "/api/generate", timeout=60,
                         json={**kw, "stream": False}).json()
        entries.append([bytes(e["bytes"]) for e in raw["logprobs"]])
        assert b"".join(entries[-1]) == raw["response"].encode()
    # NOTE: greedy: budget n's tokens are budget n+1's first n; a token's bytes shorter at n
    # than at n+1 are a partial character the budget n dropped
    cut = sum(short != longer[:n] for n, (short, longer) in
              enumerate(zip(entries, entries[1:], strict=False), start=1))
    assert cut, "no budget cut a character: the case is not exercised"


def test_p1_ollama_logprobs_with_tools_is_a_400(server_live: Any) -> None:
    """SPEC P1: ``logprobs`` beside tools (a call's text is cut out of the token stream) is a
    400 naming ``logprobs``, never logprobs that miss tokens."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = httpx.post(server_live.url + "/api/chat", timeout=60, json={
        "model": MODEL, "stream": False, "logprobs": True, "tools": [tool],
        "messages": [{"role": "user", "content": "q"}], "options": {"num_predict": 2}})
    assert r.status_code == 400 and r.json()["error"].startswith("logprobs:"), r.text
