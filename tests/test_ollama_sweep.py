"""What a sweep of the Ollama API with the official ``ollama`` client found (docs/api.md
"Ollama API"; SPEC P1): each a 400 in Ollama's ``{"error": ...}`` shape, on the real SmolLM2
server over loopback.

- ``raw: true`` with ``system``: the system text was dropped without a word (Ollama drops it
  too, as a raw prompt has no template); P1: a parameter is never silently ignored.
- A validator's message (``keep_alive: "abc"``) carried pydantic's ``Value error, `` before
  Go's words, where the docs promise Ollama's ``time: invalid duration "abc"``.
- A JSON ``null`` (what a client that writes its unset fields sends) was a 400 for
  ``stream``, ``raw``, ``logprobs``, ``prompt``, ``messages`` and a message's ``content``,
  while ``format``, ``system``, ``keep_alive``... took it as unset; Ollama (Go) reads every
  null as the field left out.
- The answer's ``model`` dropped the ``:latest`` tag the request named (``llama3:latest`` in,
  ``llama3`` out) on generate, chat, their load call and ``/api/embed``, where Ollama's
  handlers echo ``req.Model`` as sent (``OllamaRender.model``: "as the client asked for it").
"""

from __future__ import annotations

import httpx
import ollama
import pytest

from tests.conftest import LiveServer


def test_p1_raw_with_system_is_a_400_naming_system(smollm_ollama: ollama.Client,
                                                   smollm_name: str) -> None:
    """P1: a raw prompt is sent as is, so its ``system`` would be dropped: a 400 naming
    ``system``; without ``raw`` the same system is rendered (200)."""
    with pytest.raises(ollama.ResponseError) as exc:
        smollm_ollama.generate(model=smollm_name, prompt="Hi", raw=True, system="Be brief.",
                               options={"num_predict": 2})
    assert exc.value.status_code == 400
    assert exc.value.error.startswith("system: not used with raw: true")
    ok = smollm_ollama.generate(model=smollm_name, prompt="Hi", system="Be brief.",
                                options={"num_predict": 2})
    assert ok.done and ok.eval_count == 2


def test_p1_keep_alive_error_is_gos_words(smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """P1: a ``keep_alive`` Go cannot parse is a 400 in Go's words after the field's name,
    nothing of pydantic's between."""
    with pytest.raises(ollama.ResponseError) as exc:
        smollm_ollama.chat(model=smollm_name, messages=[{"role": "user", "content": "Hi"}],
                           keep_alive="abc", options={"num_predict": 2})
    assert exc.value.status_code == 400
    assert exc.value.error == 'keep_alive: time: invalid duration "abc"'


def test_p1_null_reads_as_the_field_left_out(smollm_live: LiveServer, smollm_name: str) -> None:
    """P1: ``null`` in an optional field is the field unset, as Ollama reads it: ``stream:
    null`` streams (Ollama's default), ``prompt: null`` / ``messages: null`` are the load
    call, a null ``content`` is empty text; never a 400."""
    opts = {"num_predict": 2, "temperature": 0}
    chat = httpx.post(f"{smollm_live.url}/api/chat", timeout=120, json={
        "model": smollm_name, "stream": False, "logprobs": None, "options": opts,
        "messages": [{"role": "system", "content": None}, {"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["done_reason"] == "length" and chat.json()["eval_count"] == 2
    gen = httpx.post(f"{smollm_live.url}/api/generate", timeout=120, json={
        "model": smollm_name, "prompt": "Hi", "stream": None, "raw": None, "options": opts})
    assert gen.status_code == 200, gen.text
    assert gen.headers["content-type"].startswith("application/x-ndjson")
    assert gen.text.strip().splitlines()[-1].startswith('{') and '"done":true' in gen.text
    for path, body in (("generate", {"prompt": None}), ("chat", {"messages": None})):
        load = httpx.post(f"{smollm_live.url}/api/{path}", timeout=120,
                          json={"model": smollm_name, "stream": False, **body})
        assert load.status_code == 200, load.text
        assert load.json()["done_reason"] == "load"


def test_p1_null_in_embed_reads_as_left_out(smollm_live: LiveServer, smollm_name: str) -> None:
    """P1: ``/api/embed`` with ``truncate: null`` truncates (the default); ``input: null`` is
    no input (an empty list back), as Ollama reads them; never a 400."""
    url = f"{smollm_live.url}/api/embed"
    one = httpx.post(url, timeout=120, json={"model": smollm_name, "input": "x", "truncate": None})
    assert one.status_code == 200, one.text
    assert len(one.json()["embeddings"]) == 1
    none = httpx.post(url, timeout=120, json={"model": smollm_name, "input": None})
    assert none.status_code == 200, none.text
    assert none.json()["embeddings"] == []


@pytest.mark.parametrize("tag", ["", ":latest"])
def test_p1_answer_echoes_the_model_name_as_sent(smollm_ollama: ollama.Client, smollm_name: str,
                                                 tag: str) -> None:
    """P1: every answer's ``model`` is the name the request sent, ``:latest`` kept (it routes
    to the same model): generate and chat whole and streamed, the load call, ``/api/embed``."""
    name = smollm_name + tag
    opts = {"num_predict": 2, "seed": 1}
    msgs = [{"role": "user", "content": "Hi"}]
    assert smollm_ollama.generate(model=name, prompt="Hi", options=opts).model == name
    assert {p.model for p in smollm_ollama.generate(model=name, prompt="Hi", options=opts,
                                                     stream=True)} == {name}
    assert smollm_ollama.chat(model=name, messages=msgs, options=opts).model == name
    assert {p.model for p in smollm_ollama.chat(model=name, messages=msgs, options=opts,
                                                 stream=True)} == {name}
    assert smollm_ollama.chat(model=name, messages=[]).model == name
    assert smollm_ollama.embed(model=name, input="Hi").model == name
