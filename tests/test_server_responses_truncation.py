"""Responses ``truncation: "auto"`` through the official ``openai`` client against the real app
(SPEC P1, L4; coda.server.responses_fit): a conversation past the context loses its oldest
whole turns until it fits (exact token counts by the chat template), a call and its output go
together, instructions and developer messages stay, the response echoes ``truncation`` as
sent (stored and retrieved the same), its ``coda`` object says how many input items went and
the trace has an ``input.truncated`` row;
an input that fits is answered exactly as ``"disabled"``; a last turn too long alone is the
same 400 as ``"disabled"``. The shared server's context is 512 tokens (tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from coda.server.chat import render_chat
from coda.trace import ListTraceSink
from coda.trace_check import check_trace

MODEL = "tiny-chat"
TEXT = "zq 7x kv jw 3p "  # NOTE: text the tiny tokenizer was not trained on: many tokens
OUT = 16  # max_output_tokens


@pytest.fixture
def client(server_live: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_live.url + "/v1", api_key="unused", max_retries=0)


def _tokens(server_live: Any, msgs: list[dict[str, Any]]) -> int:
    st = server_live.app.state.coda
    text = render_chat(st.engine, msgs, field="input")
    return len(st.encode(text, add_special_tokens=False, field="input"))


def _context(server_live: Any) -> int:
    return int(server_live.app.state.coda.engine.context_length)


def _expected(server_live: Any, head: list[dict[str, Any]], conv: list[dict[str, Any]],
              cuts: list[int]) -> tuple[int, int]:
    """(items dropped, prompt tokens) of the first of ``cuts`` that fits (a linear search:
    the oracle of the server's binary one); developer messages before the cut stay."""
    for cut in cuts:
        keep = [m for m in conv[:cut] if m["role"] == "developer"]
        n = _tokens(server_live, [*head, *keep, *conv[cut:]])
        if n + OUT <= _context(server_live):
            return cut - len(keep), n
    raise AssertionError("no cut fits")


def _turns(server_live: Any, over: int) -> list[dict[str, Any]]:
    """User/assistant turns whose rendering passes ``over`` tokens."""
    conv: list[dict[str, Any]] = []
    while _tokens(server_live, conv or [{"role": "user", "content": ""}]) <= over:
        i = len(conv) // 2
        conv += [{"role": "user", "content": f"{i} " + TEXT * 3},
                 {"role": "assistant", "content": f"{i} " + TEXT * 2}]
    return conv


def _dropped(r: Any) -> int:
    return int(r.model_extra["coda"]["truncation"]["dropped_items"])


def test_p1_auto_that_fits_is_exactly_disabled(client: openai.OpenAI) -> None:
    """An input that fits: the same output and usage as ``"disabled"``, nothing dropped,
    ``truncation`` echoed as sent (and retrieved the same)."""
    kw: dict[str, Any] = {"model": MODEL, "input": "Hello world", "max_output_tokens": 16,
                          "extra_body": {"seed": 3, "ignore_eos": True}}
    auto = client.responses.create(truncation="auto", **kw)
    off = client.responses.create(truncation="disabled", **kw)
    plain = client.responses.create(**kw)
    assert (auto.output_text, auto.usage.input_tokens) == (off.output_text,
                                                           off.usage.input_tokens)
    assert (auto.truncation, off.truncation, plain.truncation) == ("auto", "disabled", "disabled")
    assert _dropped(auto) == 0 and "truncation" not in off.model_extra["coda"]
    got = client.responses.retrieve(auto.id)
    assert got.truncation == "auto" and _dropped(got) == 0
    # NOTE: with background too (the field checks that background enters refuse nothing here)
    bg = client.responses.create(truncation="auto", background=True, **kw)
    assert bg.status == "queued" and bg.truncation == "auto"


def test_p1_auto_drops_the_oldest_whole_turns_to_fit(server_live: Any, client: openai.OpenAI,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the context: answered, with the fewest oldest whole turns dropped (exact count:
    ``usage.input_tokens`` is the cut prompt's), instructions and a developer message kept,
    the count in ``coda.truncation`` (streamed too) and on the retrieved response, an
    ``input.truncated`` trace row; ``"disabled"`` is a 400."""
    sink = ListTraceSink()
    monkeypatch.setattr(server_live.app.state.coda.engine, "trace", sink)
    head = [{"role": "system", "content": "be brief"}]
    conv = [{"role": "developer", "content": "answer in " + TEXT},
            *_turns(server_live, _context(server_live)),
            {"role": "user", "content": "last " + TEXT}]
    cuts = [i for i, m in enumerate(conv) if i and m["role"] == "user"]
    dropped, n = _expected(server_live, head, conv, cuts)
    assert dropped >= 2
    kw: dict[str, Any] = {"model": MODEL, "instructions": "be brief", "input": conv,
                          "max_output_tokens": OUT}
    r = client.responses.create(truncation="auto", **kw)
    assert r.status in ("completed", "incomplete") and r.truncation == "auto"
    assert (_dropped(r), r.usage.input_tokens) == (dropped, n)
    got = client.responses.retrieve(r.id)
    assert (got.truncation, _dropped(got), got.usage.input_tokens) == ("auto", dropped, n)
    rows = [e for e in sink.events if e.request_id == r.id]
    assert rows[0].kind == "input.truncated"  # NOTE: the admission fact, before the engine's
    assert (rows[0].data["dropped_items"], rows[0].data["prompt_tokens"]) == (dropped, n)
    # NOTE: the checker leaves the row alone (the swapped sink misses the core's own rows)
    assert check_trace(sink.events) == check_trace(
        [e for e in sink.events if e.kind != "input.truncated"])
    fits = client.responses.create(model=MODEL, input="hi", truncation="auto",
                                   max_output_tokens=16)
    assert "input.truncated" not in {e.kind for e in sink.events if e.request_id == fits.id}
    with client.responses.create(truncation="auto", stream=True, **kw) as stream:
        events = list(stream)
    final = events[-1].response  # type: ignore[union-attr]
    assert events[0].response.truncation == "auto"  # type: ignore[union-attr]
    assert (_dropped(final), final.usage.input_tokens) == (dropped, n)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(truncation="disabled", **kw)
    assert exc.value.body["code"] == "context_length_exceeded"  # type: ignore[index]


def test_p1_auto_never_splits_a_call_from_its_output(server_live: Any,
                                                     client: openai.OpenAI) -> None:
    """A user turn between a call and its output is no place to cut: the call and its
    output go together (here with everything before the last turn), though cutting between
    them would have fitted."""
    conv: list[dict[str, Any]] = [
        {"role": "user", "content": TEXT * 40},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"role": "user", "content": "b"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"role": "user", "content": "c"}]
    between = [{"role": "user", "content": "b"},
               {"role": "tool", "tool_call_id": "c1", "content": "ok"},
               {"role": "user", "content": "c"}]
    assert _tokens(server_live, between) + OUT <= _context(server_live)  # NOTE: would fit
    r = client.responses.create(model=MODEL, input=conv, truncation="auto",  # type: ignore[call-overload]
                                max_output_tokens=OUT)
    assert _dropped(r) == 4
    assert r.usage.input_tokens == _tokens(server_live, [{"role": "user", "content": "c"}])


def test_p1_auto_with_no_fitting_cut_is_disabled_s_400(server_live: Any,
                                                      client: openai.OpenAI) -> None:
    """The last user turn alone past the context, or a budget past it: the very 400 of
    ``"disabled"`` (``context_length_exceeded``, naming ``input`` / ``max_output_tokens``)."""
    long_turn = [{"role": "user", "content": "hi"},
                 {"role": "user", "content": TEXT * 200}]
    for kw, param in (({"input": long_turn, "max_output_tokens": OUT}, "input"),
                      ({"input": "hi", "max_output_tokens": _context(server_live) + 1},
                       "max_output_tokens")):
        bodies = []
        for mode in ("auto", "disabled"):
            with pytest.raises(openai.BadRequestError) as exc:
                client.responses.create(model=MODEL, truncation=mode, **kw)  # type: ignore[call-overload]
            bodies.append(exc.value.body)
        assert bodies[0] == bodies[1]
        assert bodies[0]["code"] == "context_length_exceeded"  # type: ignore[index]
        assert bodies[0]["param"] == param  # type: ignore[index]


def test_p1_auto_cuts_a_continued_conversation_s_history(server_live: Any,
                                                         client: openai.OpenAI) -> None:
    """With ``previous_response_id``: the inherited history's oldest turns go first; the
    previous response's own record is unchanged."""
    first = _turns(server_live, _context(server_live) // 2)
    r1 = client.responses.create(model=MODEL, input=first, max_output_tokens=16,  # type: ignore[call-overload]
                                 extra_body={"ignore_eos": True})
    new = [{"role": "user", "content": "next " + TEXT * 20}]
    conv = [*first, {"role": "assistant", "content": r1.output_text}, *new]
    assert _tokens(server_live, conv) + OUT > _context(server_live)
    cuts = [i for i, m in enumerate(conv) if i and m["role"] == "user"]
    dropped, n = _expected(server_live, [], conv, cuts)
    r2 = client.responses.create(model=MODEL, input=new, previous_response_id=r1.id,  # type: ignore[call-overload]
                                 truncation="auto", max_output_tokens=OUT)
    assert (r2.truncation, _dropped(r2), r2.usage.input_tokens) == ("auto", dropped, n)
    assert r2.previous_response_id == r1.id and dropped > 0
    assert client.responses.retrieve(r1.id).truncation == "disabled"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=new, previous_response_id=r1.id,  # type: ignore[call-overload]
                                max_output_tokens=OUT)
