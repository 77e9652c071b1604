"""Hostile bodies on every POST route (SPEC L5, P1; "bad input gets a clear error, never a 5xx,
a hang or a frozen server"): each route's own valid body, mutated by Hypothesis where a client
can go wrong — a field (top level or one level down) set to a value of the wrong kind or out of
every range (null, bools for numbers, 1e30, 2**64, NaN / Infinity literals, lone surrogates,
empty and very long strings, 1000-deep nesting), an unknown field, or the raw bytes themselves
(not an object, cut short, invalid UTF-8, duplicate keys, another Content-Type, a gzip
Content-Encoding that is not gzip). Every answer is below 500, and an error is the protocol's
own shape; afterwards ``/health`` answers, a plain request completes and every KV block is
free. The schemathesis test (test_server_schemathesis.py) covers what the OpenAPI document
describes; this one what it cannot (raw bytes, NaN, surrogates, nesting). Bounded by
CODA_HYPOTHESIS_EXAMPLES and a time budget."""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import anthropic
import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.conftest import examples
from tests.test_server_openai import MODEL

BUDGET_S = 30.0
EXAMPLES = examples(400)
DERANDOMIZE = os.environ.get("CODA_FUZZ_RANDOM") != "1"
USER = [{"role": "user", "content": "hi"}]
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": USER, "max_tokens": 2, "seed": 1,
                             "stop": ["x"], "logit_bias": {"5": 1}, "temperature": 0.5},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 1,
                        "n": 1, "top_p": 0.9},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 16,
                      "metadata": {"k": "v"}, "text": {"format": {"type": "text"}}},
    "/v1/responses/input_tokens": {"model": MODEL, "input": "hi", "instructions": "be brief"},
    "/v1/embeddings": {"model": MODEL, "input": ["hi"], "dimensions": 4},
    "/v1/messages": {"model": MODEL, "messages": USER, "max_tokens": 2, "system": "s",
                     "stop_sequences": ["x"], "thinking": {"type": "disabled"}},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": USER, "system": "s"},
    "/api/chat": {"model": MODEL, "messages": USER, "stream": False, "keep_alive": "5m",
                  "options": {"num_predict": 2, "temperature": 0.5, "seed": 3}},
    "/api/generate": {"model": MODEL, "prompt": "hi", "stream": False, "context": [1, 2],
                      "options": {"num_predict": 2, "top_k": 5, "stop": ["x"]}},
    "/api/embed": {"model": MODEL, "input": ["hi"], "truncate": True},
    "/api/embeddings": {"model": MODEL, "prompt": "hi", "options": {"seed": 1}},
    "/api/show": {"model": MODEL, "verbose": False},
}
NAN, INF = float("nan"), float("inf")
# NOTE: json.dumps writes these as NaN / Infinity literals, which Python's parser (FastAPI's)
# reads back as floats
HOSTILE: list[Any] = [None, True, False, 0, -1, 1.5, 10 ** 30, 2 ** 64, 2 ** 70, -(2 ** 63) - 1,
                      NAN, INF, -INF, "", "\ud800", "a\udfffb", "x" * 70000, [], {}, [None],
                      [""] * 100, ["x"] * 100, {"5": "x"}, {"x": NAN}, {"type": 5}]


def _deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


VALUES = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=20),
                   st.integers(min_value=-(2 ** 80), max_value=2 ** 80),
                   st.floats(allow_nan=True, allow_infinity=True),
                   st.just(_deep(1000)),
                   st.dictionaries(st.text(max_size=5), st.sampled_from(HOSTILE), max_size=3))
UNKNOWN = ["frobnicate", "n", "top_logprobs", "logprobs", "tools", "tool_choice", "format",
           "response_format", "stop_token_ids", "backpressure", "early_stop", "prediction",
           "functions", "options", "stream_options", "deadline", "min_tokens", "top_k"]


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    """A route, a body and headers: the route's body with one mutation (module doc)."""
    path = draw(st.sampled_from(sorted(ROUTES)))
    body = json.loads(json.dumps(ROUTES[path]))
    headers = {"content-type": "application/json"}
    kind = draw(st.sampled_from(["field", "field", "nested", "unknown", "raw", "header"]))
    if kind == "field":
        body[draw(st.sampled_from(sorted(body)))] = draw(VALUES)
    elif kind == "nested":
        holders = [k for k, v in body.items() if isinstance(v, (dict, list)) and v]
        key = draw(st.sampled_from(holders or sorted(body)))
        holder = body[key]
        if isinstance(holder, list) and isinstance(holder[0], dict):
            holder = holder[0]
        if isinstance(holder, dict):
            holder[draw(st.sampled_from([*sorted(holder), "type", "content", "role", "x"]))] = (
                draw(VALUES))
        elif isinstance(holder, list):
            holder[0] = draw(VALUES)
    elif kind == "unknown":
        body[draw(st.sampled_from(UNKNOWN))] = draw(VALUES)
    raw = json.dumps(body, allow_nan=True).encode()
    if kind == "raw":
        raw = draw(st.sampled_from([
            b"", b"null", b"[]", b"1", b'"x"', raw[: len(raw) // 2], b"\xff\xfe" + raw,
            raw.replace(b'"hi"', b'"h\xc3("'), raw[:-1] + b', "model": 5}',
            b"[" * 1000 + b"]" * 1000, b"[" * 100000 + b"]" * 100000]))
    elif kind == "header":
        headers = draw(st.sampled_from([{"content-type": "text/plain"}, {},
                                        {"content-type": "application/json",
                                         "content-encoding": "gzip"},
                                        {"content-type": "application/json; charset=latin-1"},
                                        {"content-type": "multipart/form-data; boundary=x"}]))
    return path, raw, headers


def protocol_error(path: str, resp: httpx.Response) -> str | None:
    """What is wrong with an error answer's shape (None: the protocol's own)."""
    try:
        body = resp.json()
    except ValueError:
        return "not JSON"
    if path.startswith("/api/"):
        ok = isinstance(body, dict) and isinstance(body.get("error"), str)
    elif path.startswith("/v1/messages"):
        err = body.get("error") if isinstance(body, dict) else None
        ok = (body.get("type") == "error" and isinstance(err, dict)
              and isinstance(err.get("type"), str) and isinstance(err.get("message"), str))
    else:
        err = body.get("error") if isinstance(body, dict) else None
        ok = isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)
    return None if ok else "not the protocol's error shape"


class _OutOfTime(Exception):
    """The budget is spent: ends the examples (not a failure)."""


def test_hostile_bodies_get_a_4xx_in_the_protocol_shape(server_live: Any,
                                                        server_settle: Any) -> None:
    """SPEC L5, P1: see the module doc."""
    started = time.monotonic()
    failures: list[str] = []
    codes: dict[int, int] = {}
    client = httpx.Client(base_url=server_live.url, timeout=30)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
              suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate))
    @given(case=mutated())
    def run(case: tuple[str, bytes, dict[str, str]]) -> None:
        if time.monotonic() - started > BUDGET_S:
            raise _OutOfTime
        path, raw, headers = case
        try:
            resp = client.post(path, content=raw, headers=headers)
        except httpx.HTTPError as exc:  # NOTE: a hang (timeout) or a dropped connection
            failures.append(f"{path} {raw[:200]!r} -> {type(exc).__name__}")
            return
        codes[resp.status_code] = codes.get(resp.status_code, 0) + 1
        wrong = ("a 5xx" if resp.status_code >= 500 else
                 protocol_error(path, resp) if resp.status_code >= 400 else None)
        if wrong:
            failures.append(f"{path} {headers} {raw[:200]!r} -> {resp.status_code} {wrong}: "
                            f"{resp.text[:300]}")

    with contextlib.suppress(_OutOfTime):
        run()
    print(f"\n[hostile fuzz] {sum(codes.values())} requests in "
          f"{time.monotonic() - started:.1f}s, status codes {dict(sorted(codes.items()))}")
    assert not failures, failures[:5]
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER,
                                                    "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"], ok.text
    stats = server_settle(20)
    assert stats.num_free_blocks == stats.num_blocks


# NOTE: raw JSON: Python's parser reads NaN / Infinity literals (not JSON) and 1e400 (inf)
NON_FINITE = [
    ("/v1/responses", b'{"model": "%s", "input": "hi", "max_output_tokens": 16, '
                      b'"text": {"format": {"type": "text", "x": NaN}}}', "text.format.x"),
    ("/v1/responses", b'{"model": "%s", "input": "hi", "max_output_tokens": 16, '
                      b'"reasoning": {"summary": Infinity}}', "reasoning.summary"),
    ("/v1/chat/completions", b'{"model": "%s", "max_tokens": 2, "store": true, "messages": '
                             b'[{"role": "user", "content": "hi", "x": 1e400}]}',
     "messages[0].x"),
    ("/api/chat", b'{"model": "%s", "stream": false, "messages": [{"role": "user", '
                  b'"content": "hi"}], "keep_alive": -Infinity}', "keep_alive"),
]


def test_non_finite_numbers_are_a_400_naming_their_path(server_live: Any) -> None:
    """SPEC L5, P1: NaN, Infinity and a number past a float's range are no JSON; a field that
    takes any value (``text.format``, a message's extra keys) passed them on, and an answer
    echoing one was a 500 ("Out of range float values are not JSON compliant") after the
    request had run. Each is a 400 in the protocol's shape naming the value's path."""
    for path, raw, where in NON_FINITE:
        r = httpx.post(server_live.url + path, content=raw.replace(b"%s", MODEL.encode()),
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert protocol_error(path, r) is None, r.text
        body = r.json()
        message = body["error"] if path.startswith("/api/") else body["error"]["message"]
        assert message.startswith(f"{where}: must be a finite number"), body
    assert httpx.get(server_live.url + "/v1/chat/completions").status_code == 200


def test_anthropic_thinking_type_of_another_kind_is_a_400(an: anthropic.Anthropic) -> None:
    """SPEC P1: ``thinking.type`` an object or a list (not a string), as the official client
    sends it, was a TypeError (a 500: unhashable in the type lookup); it is Anthropic's 400
    naming ``thinking.type``."""
    for kind in ({"x": 1}, ["enabled"]):
        thinking: Any = {"type": kind}
        with pytest.raises(anthropic.BadRequestError) as err:
            an.messages.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                               max_tokens=2, thinking=thinking)
        body: Any = err.value.body
        assert body["error"]["type"] == "invalid_request_error", body
        assert "thinking.type" in err.value.message, err.value.body
