"""A confidence early stop takes the cancel path (issue 8 defect 7; SPEC D6, D2, G2, L4, K3,
C1; seed 004), in the engine and on the wire.

The scripted default model answers ``x``, ``A``, a lone ``0xC3``, EOS. With ``stop=["AB"]`` the
``A`` is held back as a possible stop prefix; with a confidence stop after token 2 or 3 the
held ``A`` and the pending ``0xC3`` are discarded (never flushed, never a decoding failure).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from coda.early_stop import EarlyStopPolicy
from coda.engine.types import GenerationRequest
from coda.finish import FinishReason
from coda.lifecycle import State
from coda.sampling import SamplingParams
from coda.trace import ListTraceSink, check_trace
from tests.wire_support import C3_ID, EOS_ID, X_ID, ScriptedServer, scripted_server

A_ID = 35
CHAIN = {X_ID: A_ID, A_ID: C3_ID, C3_ID: EOS_ID}
MODEL = "default_model"
MSG = [{"role": "user", "content": "hi"}]


def confident(min_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"min_tokens": min_tokens, "max_tokens": 50, "deadline_ms": 600_000,
            "confidence_threshold": 0.0, "no_retry_after_first_frame": True, **kw}


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    yield from scripted_server(CHAIN)


def submit(server: ScriptedServer, early: dict[str, Any] | None, **kw: Any) -> Any:
    req = GenerationRequest((1, 2, 3), SamplingParams(), max_tokens=10,
                            early_stop=EarlyStopPolicy.from_dict(early) if early else None, **kw)
    return server.engine.submit(req).wait(30)


def test_d6_k3_confidence_stop_inside_a_character_is_cancelled_not_failed(
        server: ScriptedServer) -> None:
    """D6/K3: a confidence stop right after ``0xC3`` discards the pending byte: CANCELLED with
    confidence_stop and text ``xA`` (the same script without the policy ends FAILED)."""
    term = submit(server, confident(3))
    assert term.state is State.CANCELLED and term.error_code is None
    assert term.finish_reason is FinishReason.CONFIDENCE_STOP
    assert term.usage.selected_tokens == 3 and term.usage.returned_bytes == 2
    assert term.early_stop is not None and term.early_stop["reason"] == "confidence"
    assert submit(server, None).state is State.FAILED  # the control: K3 at the drain


def test_d6_g2_held_stop_bytes_are_discarded_not_flushed(server: ScriptedServer) -> None:
    """D6/G2: ``A`` held back for ``stop=["AB"]`` is discarded by an early stop (finish() is
    not called), where a normal end would have flushed it."""
    from coda.engine.async_engine import AsyncEngine

    engine: AsyncEngine = server.engine
    sink = ListTraceSink()
    old, engine.trace = engine.trace, sink
    engine.core.trace, engine.core._tracing = sink, True  # NOTE: trace this request only
    try:
        req = GenerationRequest((1, 2, 3), SamplingParams(), max_tokens=10, stop=("AB",),
                                early_stop=EarlyStopPolicy.from_dict(confident(2)),
                                request_id="early-held")
        h = engine.submit(req)
        term = h.wait(30)
        rows = sink.of("early-held")  # NOTE: sealed before wait() returns (O1)
    finally:
        engine.trace = engine.core.trace = old
        engine.core._tracing = False
    assert h.stream.text() == "x" and term.state is State.CANCELLED
    assert term.finish_reason is FinishReason.CONFIDENCE_STOP
    kinds = [r.kind for r in rows]
    assert "cancel.requested" in kinds and "cancel.effective" in kinds
    assert not any(r.kind == "lifecycle" and r.data["to"] == "DRAINING" for r in rows)
    req_row = next(r for r in rows if r.kind == "cancel.requested")
    assert req_row.data == {"cause": "early_stop", "reason": "confidence_stop"}
    assert check_trace(rows) == []


def test_d6_policy_budget_keeps_its_reason(server: ScriptedServer) -> None:
    """D2/D6: the policy's own budget stop ends CANCELLED with max_output_tokens."""
    term = submit(server, confident(2, max_tokens=2))
    assert term.state is State.CANCELLED
    assert term.finish_reason is FinishReason.MAX_OUTPUT_TOKENS


def test_d6_l4_wire_reads_as_a_normal_end(server: ScriptedServer) -> None:
    """On the wire a confidence stop is a normal end — OpenAI ``stop``, Anthropic
    ``end_turn``, Responses ``completed`` — and ``coda`` says CANCELLED, confidence_stop and
    the early-stop summary. A policy budget stop stays a truncation (``length``)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    extra = {"early_stop": confident(3)}
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10,
                                       extra_body=extra)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "xA"
    coda = choice.model_extra["coda"]  # type: ignore[index]
    assert coda["state"] == "CANCELLED" and coda["finish_reason"] == "confidence_stop"
    assert coda["early_stop"]["reason"] == "confidence" and "error" not in coda
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10,
                                                 stream=True, extra_body=extra))
    assert chunks[-1].choices[0].finish_reason == "stop"
    budget = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=10,
        extra_body={"early_stop": confident(2, max_tokens=2)})
    assert budget.choices[0].finish_reason == "length"
    resp = client.responses.create(model=MODEL, input="hi", max_output_tokens=16,
                                   extra_body=extra)
    assert resp.status == "completed" and resp.output_text == "xA"
    assert resp.model_extra["coda"]["state"] == "CANCELLED"  # type: ignore[index]
    claude = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
    msg = claude.messages.create(model=MODEL, max_tokens=10, messages=MSG,  # type: ignore[arg-type]
                                 extra_body=extra)
    assert msg.stop_reason == "end_turn"
    assert msg.model_extra["coda"]["finish_reason"] == "confidence_stop"  # type: ignore[index]
