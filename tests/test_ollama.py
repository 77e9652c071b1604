"""The Ollama API through the official ``ollama`` client over loopback, on the real SmolLM2
model (issue 23 item 2; SPEC P1, P2, L4, L5, L6, S1, K2), plus the NDJSON renderer over
scripted streams for every ending (a FAILED request included, which the real model does
not produce on demand)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.reader import replay
from coda.server.ollama_routes import CHAT, GENERATE
from coda.server.ollama_wire import done_reason
from coda.server.records import Record
from coda.server.render_spec import OllamaRender
from coda.stream import RequestStream
from tests.conftest import examples
from tests.tools_support import OLLAMA_WEATHER as WEATHER

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def _lines(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every NDJSON line of a stream, read raw (the client stops at ``done``)."""
    with httpx.stream("POST", url + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in resp.iter_lines() if line]


def test_l6_p1_chat_streamed_equals_whole_with_one_done_last(
        smollm_ollama: ollama.Client, smollm_name: str, smollm_live: Any) -> None:
    """L6, P1, P2: a seeded sampled chat streams the text it returns whole; the raw stream has
    exactly one ``done: true`` object, last, with Coda's counts and nanosecond durations."""
    opts = {"temperature": 0.9, "seed": 5, "num_predict": 24}
    whole = smollm_ollama.chat(model=smollm_name, messages=CAPITAL, options=opts, stream=False)
    parts = list(smollm_ollama.chat(model=smollm_name, messages=CAPITAL, options=opts, stream=True))
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    last = parts[-1]
    assert last.done_reason == whole.done_reason and last.eval_count == whole.eval_count
    raw = _lines(smollm_live.url, "/api/chat",
                 {"model": smollm_name, "messages": CAPITAL, "options": opts})
    assert [o["done"] for o in raw].count(True) == 1 and raw[-1]["done"] is True
    end = raw[-1]
    usage = end["coda"]["usage"]
    assert end["eval_count"] == usage["selected_tokens"] > 0
    assert end["prompt_eval_count"] == usage["prompt_tokens"] - usage["cached_prompt_tokens"]
    timings = end["coda"]["timings"]
    assert end["total_duration"] == round(timings["total_s"] * 1e9)
    assert end["eval_duration"] == round(timings["decode_s"] * 1e9)
    assert "".join(o["message"]["content"] for o in raw) == whole.message.content


def test_p1_generate_streamed_and_not_greedy_answer(smollm_ollama: ollama.Client,
                                                    smollm_name: str) -> None:
    """P1: generate through the chat template answers, streamed and not, the same text."""
    whole = smollm_ollama.generate(model=smollm_name, prompt="What is the capital of France?",
                            options={"temperature": 0}, stream=False)
    assert "Paris" in whole.response and whole.done_reason == "stop"
    parts = list(smollm_ollama.generate(model=smollm_name, prompt="What is the capital of France?",
                                 options={"temperature": 0}, stream=True))
    assert "".join(p.response or "" for p in parts) == whole.response
    assert parts[-1].done and not any(p.done for p in parts[:-1])


def test_l4_options_map_to_sampling(smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """L4: ``num_predict`` is the output budget (done_reason ``length``, exactly that many
    tokens); a seeded temperature sample repeats; greedy differs from nothing it should."""
    r = smollm_ollama.generate(model=smollm_name, prompt="Count to twenty:",
                        options={"num_predict": 5, "temperature": 0}, stream=False)
    assert r.done_reason == "length" and r.eval_count == 5
    opts = {"temperature": 1.2, "top_p": 0.95, "top_k": 50, "seed": 123, "num_predict": 20}
    a = smollm_ollama.chat(model=smollm_name, messages=CAPITAL, options=opts, stream=False)
    b = smollm_ollama.chat(model=smollm_name, messages=CAPITAL, options=opts, stream=False)
    assert a.message.content == b.message.content
    others = {smollm_ollama.chat(model=smollm_name, messages=CAPITAL, stream=False,
                          options={**opts, "seed": s}).message.content for s in range(4)}
    assert len(others) > 1  # NOTE: the seed reaches the sampler (else all four would agree)


def test_s1_stop_never_leaked(smollm_ollama: ollama.Client, smollm_name: str,
                              smollm_live: Any) -> None:
    """S1: ``options.stop`` ends the answer before the stop string, streamed and not; the
    matched stop is named in ``coda``, and done_reason is ``stop``."""
    free = smollm_ollama.chat(model=smollm_name, messages=CAPITAL, options={"temperature": 0},
                       stream=False).message.content or ""
    assert "Paris" in free
    cut = free.index("Paris")
    opts = {"temperature": 0, "stop": ["Paris"]}
    whole = smollm_ollama.chat(model=smollm_name, messages=CAPITAL, options=opts, stream=False)
    assert whole.message.content == free[:cut] and whole.done_reason == "stop"
    raw = _lines(smollm_live.url, "/api/chat",
                 {"model": smollm_name, "messages": CAPITAL, "options": opts})
    assert "".join(o["message"]["content"] for o in raw) == free[:cut]
    assert raw[-1]["coda"]["matched_stop"] == "Paris" and raw[-1]["done_reason"] == "stop"


def test_format_json_schema_and_json(smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """Structured output: ``format`` as a JSON schema gives JSON that validates against it,
    streamed and not; ``"json"`` gives a JSON object."""
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Name a city and its population as JSON."}]
    r = smollm_ollama.chat(model=smollm_name, messages=msgs, format=schema, stream=False,
                    options={"temperature": 0, "num_predict": 60})
    jsonschema.validate(json.loads(r.message.content or ""), schema)
    streamed = "".join(p.message.content or "" for p in smollm_ollama.chat(
        model=smollm_name, messages=msgs, format=schema, stream=True,
        options={"temperature": 0, "num_predict": 60}))
    assert streamed == r.message.content
    g = smollm_ollama.generate(model=smollm_name, prompt="Describe Paris as JSON.", format="json",
                        options={"temperature": 0, "num_predict": 40}, stream=False)
    assert isinstance(json.loads(g.response), dict)


class _ToolChoice(httpx.HTTPTransport):
    """Adds Coda's ``tool_choice`` extension to the official client's body (Ollama has no
    such field; a 135M model seldom calls a tool on its own)."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        body["tool_choice"] = "required"
        content = json.dumps(body).encode()
        request = httpx.Request(request.method, request.url, content=content,
                                headers={**request.headers, "content-length": str(len(content))})
        return super().handle_request(request)


def test_tools_come_back_as_message_tool_calls(smollm_live: Any, smollm_name: str) -> None:
    """Tool calling: a call comes back in ``message.tool_calls`` with object arguments that
    satisfy the tool's schema, streamed and not; the call's bytes are not in ``content``."""
    c = ollama.Client(host=smollm_live.url, transport=_ToolChoice())
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat(model=smollm_name, messages=msgs, tools=[WEATHER], stream=False,
               options={"temperature": 0})
    calls = r.message.tool_calls or []
    assert len(calls) >= 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(dict(calls[0].function.arguments),
                        WEATHER["function"]["parameters"])  # type: ignore[index]
    assert "<tool_call>" not in (r.message.content or "")
    parts = list(c.chat(model=smollm_name, messages=msgs, tools=[WEATHER], stream=True,
                        options={"temperature": 0}))
    streamed = [k for p in parts for k in (p.message.tool_calls or [])]
    assert [(k.function.name, dict(k.function.arguments)) for k in streamed] == [
        (k.function.name, dict(k.function.arguments)) for k in calls]
    assert parts[-1].done


def test_tags_show_ps_version_shapes(smollm_ollama: ollama.Client, smollm_name: str,
                                     smollm_live: Any) -> None:
    """The model endpoints parse in the official client and name the served model."""
    models = smollm_ollama.list().models
    assert [m.model for m in models] == [smollm_name]
    assert models[0].digest and models[0].details is not None
    # NOTE: Ollama's implicit tag names the same model
    shown = smollm_ollama.show(smollm_name + ":latest")
    assert shown.template and "tools" in (shown.capabilities or [])
    assert shown.modelinfo and shown.modelinfo["coda.context_length"] == 1024
    assert [m.model for m in smollm_ollama.ps().models] == [smollm_name]
    assert httpx.get(smollm_live.url + "/api/version").json()["version"]


@pytest.mark.parametrize(("body", "status", "word"), [
    ({"options": {"mirostat": 2}}, 400, "mirostat"),
    ({"options": {"num_predictt": 3}}, 400, "num_predictt"),
    ({"options": {"num_predict": 0}}, 400, "num_predict"),
    ({"format": "xml"}, 400, "format"),
    ({"think": True}, 400, "think"),
    ({"model": "no-such-model"}, 404, "no-such-model"),
])
def test_bad_input_is_a_4xx_in_ollama_shape(smollm_live: Any, smollm_ollama: ollama.Client,
                                             smollm_name: str, body: dict[str, Any], status: int,
                                             word: str) -> None:
    """Bad input: a 4xx with ``{"error": "..."}``; the client raises ResponseError with it."""
    full = {"model": smollm_name, "messages": CAPITAL, "stream": False, **body}
    resp = httpx.post(smollm_live.url + "/api/chat", json=full, timeout=60)
    assert resp.status_code == status
    assert list(resp.json()) == ["error"] and word in resp.json()["error"]
    if body.get("format") != "xml":  # NOTE: the client itself refuses that one
        with pytest.raises(ollama.ResponseError) as exc:
            smollm_ollama.chat(**{k: v for k, v in full.items()  # type: ignore[arg-type]
                                  if k != "stream"})
        assert exc.value.status_code == status and word in exc.value.error
    bad = httpx.post(smollm_live.url + "/api/generate", content=b"{nope", timeout=60)
    assert bad.status_code == 400 and isinstance(bad.json()["error"], str)


def test_empty_request_loads(smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """Ollama's load call: an empty prompt answers ``done_reason: "load"`` at once."""
    r = smollm_ollama.generate(model=smollm_name + ":latest", prompt="", stream=False)
    assert r.done and r.done_reason == "load" and r.response == ""
    assert r.model == smollm_name + ":latest"  # NOTE: echoed as sent, as Ollama's req.Model


# -- the renderer over scripted streams: every ending, FAILED included ----------------------
_STATE = {FinishReason.MODEL_ERROR: State.FAILED, FinishReason.CANCELLED: State.CANCELLED,
          FinishReason.TRANSPORT_ERROR: State.CANCELLED,
          FinishReason.DEADLINE_EXCEEDED: State.CANCELLED}


def _record(chat: bool, pieces: list[str], reason: FinishReason) -> Record:
    s = RequestStream("r")
    s.start("m")
    for p in pieces:
        s.delta(p.encode())
    s.close(Terminal(_STATE.get(reason, State.FINISHED), reason,
                     Usage(prompt_tokens=3, selected_tokens=len(pieces)),
                     error_message="boom" if reason is FinishReason.MODEL_ERROR else None))
    spec = OllamaRender(chat=chat, model="m")
    return Record("r", "ollama", [SimpleNamespace(stream=s)], 0, "m", spec)  # type: ignore[list-item]


def _render(record: Record) -> list[dict[str, Any]]:
    r = record.make_renderer(None)
    out = []
    for ev in replay(record.streams[0]):
        for f in r.on_event(0, ev, [ev.seq]):
            raw = f.encode()
            assert raw.endswith(b"\n") and raw.count(b"\n") == 1  # NOTE: one line per object
            out.append(json.loads(raw))
    return out


@settings(deadline=None, max_examples=examples(60))
@given(chat=st.booleans(), pieces=st.lists(st.text(min_size=1, max_size=4), max_size=5),
       reason=st.sampled_from(list(FinishReason)))
def test_l6_l4_every_ending_one_done_last_truthful_reason(chat: bool, pieces: list[str],
                                                          reason: FinishReason) -> None:
    """L6, L4, L5: for every text and every ending, exactly one ``done: true`` object, last;
    the text is the deltas'; done_reason is ``stop`` / ``length`` or Coda's exact reason, never
    a natural end for a truncation; a FAILED request ends in ``{"error": ...}``, which the
    official client raises."""
    objs = _render(_record(chat, pieces, reason))
    assert [o["done"] for o in objs] == [False] * (len(objs) - 1) + [True]
    key = "message" if chat else "response"
    text = "".join((o[key]["content"] if chat else o[key]) for o in objs if key in o)
    assert text == "".join(pieces)
    end = objs[-1]
    assert end["coda"]["finish_reason"] == reason.value
    if reason is FinishReason.MODEL_ERROR:
        assert end["error"] == "boom" and "done_reason" not in end
        return
    assert end["done_reason"] == done_reason(reason)
    if reason in (FinishReason.EOS, FinishReason.STOP_SEQUENCE):
        assert end["done_reason"] == "stop"
    elif reason in (FinishReason.MAX_OUTPUT_TOKENS, FinishReason.CONTEXT_LIMIT):
        assert end["done_reason"] == "length"
    elif reason in (FinishReason.CANCELLED, FinishReason.DEADLINE_EXCEEDED,
                    FinishReason.TRANSPORT_ERROR):
        assert end["done_reason"] == reason.value


@pytest.mark.parametrize("adapter", [CHAT, GENERATE])
def test_l5_failed_call_not_streamed_is_500_with_error(adapter: Any) -> None:
    """L5: a FAILED call that did not stream is HTTP 500 (no retry) with Ollama's ``error``,
    the partial text and the exact outcome."""
    record = _record(adapter.chat, ["par", "tial"], FinishReason.MODEL_ERROR)
    resp = adapter.final(record, [record.streams[0].terminal])
    body = json.loads(bytes(resp.body))
    assert resp.status_code == 500 and resp.headers["x-should-retry"] == "false"
    assert body["error"] == "boom" and body["coda"]["state"] == "FAILED"
    assert (body["message"]["content"] if adapter.chat else body["response"]) == "partial"


def test_keep_alive_zero_unloads_with_several_models_and_is_ignored_with_one(
        smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """``keep_alive: 0`` unloads the model where the server runs a ModelRouter (it leaves
    ``/api/ps``; the next request loads it again); with one model it has no effect (the empty
    call answers ``load`` and the model stays listed)."""
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app
    from coda.server.model_router import build_router
    from coda.server.model_specs import ModelSpec
    from tests.conftest import LiveServer

    one = smollm_ollama.generate(model=smollm_name, prompt="", keep_alive=0, stream=False)
    assert one.done_reason == "load"
    assert [m.model for m in smollm_ollama.ps().models] == [smollm_name]
    router = build_router([ModelSpec(None, "x")], EngineConfig(max_num_seqs=2,
                                                               kv_cache_bytes=8 << 20))
    live = LiveServer(create_app(router)).start()
    try:
        c = ollama.Client(host=live.url)
        assert c.ps().models == []  # NOTE: not loaded before its first use
        r = c.generate(model="x", prompt="hi", options={"num_predict": 3}, stream=False)
        assert r.done and [m.model for m in c.ps().models] == ["x"]
        gone = c.generate(model="x", prompt="", keep_alive=0, stream=False)
        assert gone.done_reason == "unload" and c.ps().models == []
        again = c.chat(model="x", messages=CAPITAL, options={"num_predict": 3}, stream=False)
        assert again.done and [m.model for m in c.ps().models] == ["x"]
    finally:
        live.stop()


def test_p2_quiet_ndjson_stream_writes_no_keepalive_line() -> None:
    """P2: a stream quiet for many keepalive periods (queued, prefilling) writes nothing but
    JSON lines through the shared pump: the NDJSON framing has no keepalive comment, which
    would break every Ollama client's ``json.loads`` per line."""
    import asyncio

    from coda.server.sse import SSEResponse

    s = RequestStream("q")
    s.start("m")
    record = Record("q", "ollama", [SimpleNamespace(stream=s)], 0, "m",  # type: ignore[list-item]
                    OllamaRender(chat=False, model="m"))
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # NOTE: the client stays connected
        return {}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> None:
        resp = SSEResponse([s], record.make_renderer(None), keepalive_s=0.01)
        pump = asyncio.ensure_future(resp({"type": "http"}, receive, send))
        await asyncio.sleep(0.2)  # NOTE: about 20 keepalive periods with nothing to say
        s.delta(b"hi")
        s.close(Terminal(State.FINISHED, FinishReason.EOS, Usage(prompt_tokens=1,
                                                                 selected_tokens=1)))
        await asyncio.wait_for(pump, 10)

    asyncio.run(run())
    head = sent[0]
    assert dict(head["headers"])[b"content-type"] == b"application/x-ndjson"
    body = b"".join(m.get("body", b"") for m in sent[1:])
    lines = body.decode().splitlines()
    assert [json.loads(x)["done"] for x in lines] == [False, True]
    assert body.endswith(b"\n")


def test_tool_history_round_trip(smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """A conversation that carries an assistant tool call (object arguments) and its result
    (``tool_name``) renders and answers, as an Ollama tool loop sends it back."""
    msgs = [*CAPITAL,
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
    r = smollm_ollama.chat(model=smollm_name, messages=msgs, tools=[WEATHER], stream=False,
                    options={"temperature": 0, "num_predict": 8})
    assert r.done and r.done_reason in ("stop", "length") and r.eval_count


def test_prompt_over_the_context_is_a_400(smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """A prompt longer than the context: 400 in Ollama's shape before any work."""
    with pytest.raises(ollama.ResponseError) as exc:
        smollm_ollama.generate(model=smollm_name, prompt="word " * 3000, raw=True)
    assert exc.value.status_code == 400 and exc.value.error


def test_show_details_and_model_info_describe_the_loaded_model(smollm_ollama: ollama.Client,
                                                               smollm_name: str) -> None:
    """``/api/show`` through the client's ``show()``: ``details`` (family and families = the
    architecture, parameter size as Ollama writes it, the GGUF's quantization level) and
    ``model_info`` (GGUF metadata keys Open WebUI reads) describe SmolLM2-135M Q4_1; ``list()``
    carries the same details."""
    shown = smollm_ollama.show(smollm_name)
    d = shown.details
    assert d is not None and d.family == "llama" and d.families == ["llama"]
    assert d.parameter_size == "134.52M" and d.quantization_level == "Q4_1"
    info = shown.modelinfo or {}
    assert info["general.architecture"] == "llama"
    assert info["general.parameter_count"] == 134_515_008
    assert info["general.file_type"] == 3  # NOTE: llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_1
    assert info["llama.context_length"] == 1024
    listed = smollm_ollama.list().models[0].details
    assert listed is not None and listed.parameter_size == "134.52M"
    assert listed.family == "llama" and listed.quantization_level == "Q4_1"


@pytest.mark.parametrize(("count", "text"), [
    (134_515_008, "134.52M"), (135_000_000, "135M"), (1_235_814_400, "1.2B"),
    (7_000_000_000, "7B"), (494_032_768, "494.03M"), (22_400, "22K"), (999, "999"), (0, "")])
def test_parameter_size_is_written_as_ollama_writes_it(count: int, text: str) -> None:
    """Billions with one decimal, millions with two, none when whole, thousands rounded."""
    from coda.server.ollama_info import parameter_size

    assert parameter_size(count) == text
