"""The ``utf8_tail`` extension: ``auto`` (default: a partial last character cut by a budget is
removed and recorded, any other end with one is FAILED; tests/test_wire_endings.py),
``fail`` (the seed's strict K3 rule) or ``drop`` (the incomplete tail is removed, recorded,
and the request ends FINISHED with the loop's reason) (issues 8, 20; SPEC K2, K3, L4, O1).

The scripted default model answers ``x``, a lone ``0xC3``, EOS.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from coda.engine.types import GenerationRequest
from coda.finish import FINISH_REASON_VERSION, FinishReason
from coda.lifecycle import State
from coda.sampling import SamplingParams
from coda.stops import STOP_RULE_VERSION
from coda.trace import ListTraceSink, check_trace
from tests.wire_support import ScriptedServer, scripted_server

MODEL = "default_model"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    yield from scripted_server()


def test_k2_k3_drop_removes_and_records_the_tail(server: ScriptedServer) -> None:
    """K2/K3: with ``drop`` the request ends FINISHED(eos) with text ``x``; the removed byte
    is in the terminal and in the trace (a utf8_tail.dropped row and the terminal row), and the
    trace passes the checker. With ``fail`` the same script ends FAILED(decoding_error)."""
    engine = server.engine
    sink = ListTraceSink()
    old = engine.trace
    engine.trace = engine.core.trace = sink
    engine.core._tracing = True
    try:
        h = engine.submit(GenerationRequest((1, 2, 3), SamplingParams(), max_tokens=8,
                                            utf8_tail="drop", request_id="drop-1"))
        term = h.wait(30)
        rows = sink.of("drop-1")  # NOTE: sealed before wait() returns (O1)
    finally:
        engine.trace = engine.core.trace = old
        engine.core._tracing = False
    assert term.state is State.FINISHED and term.finish_reason is FinishReason.EOS
    assert term.error_code is None and h.stream.text() == "x"
    assert term.dropped_tail == b"\xc3"
    dropped = [r for r in rows if r.kind == "utf8_tail.dropped"]
    assert [r.data for r in dropped] == [{"nbytes": 1, "hex": "c3"}]
    assert next(r for r in rows if r.kind == "terminal").data["dropped_tail_hex"] == "c3"
    assert check_trace(rows) == []
    failed = engine.submit(GenerationRequest((1, 2, 3), SamplingParams(), max_tokens=8)).wait(30)
    assert failed.state is State.FAILED and failed.dropped_tail == b""


def test_k2_drop_on_the_wire_is_a_normal_end_with_the_removed_bytes(server: ScriptedServer
                                                                     ) -> None:
    """Through the openai client: ``utf8_tail: "drop"`` answers 200, ``stop``, text ``x``, and
    ``coda.utf8_tail_dropped`` names the removed byte; a bad value is a 400 naming the field."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8,
                                       extra_body={"utf8_tail": "drop"})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "x"
    coda = choice.model_extra["coda"]  # type: ignore[index]
    assert coda["state"] == "FINISHED" and coda["finish_reason"] == "eos"
    assert coda["utf8_tail_dropped"] == {"bytes": 1, "hex": "c3"}
    assert coda["versions"] == {"finish_reason": FINISH_REASON_VERSION,
                              "stop_rule": STOP_RULE_VERSION}  # L4, S4
    bad = httpx.post(server.url + "/v1/chat/completions",
                     json={"model": MODEL, "messages": MSG, "utf8_tail": "keep"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "utf8_tail"


def test_k3_engine_rejects_an_unknown_policy(server: ScriptedServer) -> None:
    from coda.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        server.engine.submit(GenerationRequest((1, 2), utf8_tail="keep"))
    assert err.value.field == "utf8_tail"
