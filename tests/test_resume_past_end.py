"""A resume point the stream never sent is a 400, never a silent replay (SPEC P3).

``GET /v1/streams/{id}`` with a ``Last-Event-ID`` (or ``after``) past a finished stream's
terminal — one choice's number of an ``n = 2`` stream included — and ``GET
/v1/responses/{id}?stream=true`` with a ``starting_after`` / ``Last-Event-ID`` past the
response's last ``sequence_number``, or a ``Last-Event-ID`` that is no number, answer a 400 in
OpenAI's error shape naming the cursor; every id the stream did send still resumes (200).
Before, the first were a 200 with an empty (or footer-only) body and, for ``n = 2``, frames
whose ids carried the client's bogus number (``6,999``); the Responses header was ignored and
the whole log replayed.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
from hypothesis import given
from hypothesis import strategies as st

from tests.test_server_openai import MODEL


def _resume(url: str, rid: str, last_event_id: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/streams/{rid}", headers={"Last-Event-ID": last_event_id},
                     timeout=30)


def _chat_stream(url: str, n: int) -> tuple[str, list[int]]:
    """A finished streamed chat (official client): its id and each choice's terminal seq."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    rid = ""
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=n,
            seed=1, stream=True):
        rid = chunk.id
    ids = _resume(url, rid, ",".join(["-1"] * n)).text
    last = [line for line in ids.splitlines() if line.startswith("id: ")][-1]
    return rid, [int(p) for p in last[4:].split(",")]


_CHAT: dict[str, tuple[str, list[int]]] = {}  # NOTE: one finished stream per server


def _assert_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error", r.text
    assert err["param"] == param, r.text


@given(past=st.integers(min_value=1, max_value=10**6), choice=st.integers(0, 1),
       back=st.integers(min_value=0, max_value=3))
def test_p3_stream_resume_past_the_terminal_is_a_400(server_live: Any, past: int, choice: int,
                                                     back: int) -> None:
    """P3: for all n = 2 ids with one choice's number past its terminal: 400 naming
    ``Last-Event-ID``; the same id with that number at or before the terminal: 200."""
    rid, ends = _CHAT.get(server_live.url) or _CHAT.setdefault(
        server_live.url, _chat_stream(server_live.url, 2))
    beyond = list(ends)
    beyond[choice] += past
    _assert_400(_resume(server_live.url, rid, ",".join(map(str, beyond))), "Last-Event-ID")
    sent = list(ends)
    sent[choice] = max(-1, sent[choice] - back)
    assert _resume(server_live.url, rid, ",".join(map(str, sent))).status_code == 200


def test_p3_message_resume_past_the_terminal_is_a_400(server_live: Any) -> None:
    """P3, Anthropic: a message stream (official client) resumed past its terminal → 400;
    ``after=`` is read as ``Last-Event-ID``; its last id itself → 200."""
    client = anthropic.Anthropic(base_url=server_live.url, api_key="k", max_retries=0)
    with client.messages.stream(model=MODEL, max_tokens=4,
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        rid = stream.get_final_message().id
    end = int(_resume(server_live.url, rid, "-1").text.split("id: ")[-1].split()[0])
    _assert_400(_resume(server_live.url, rid, str(end + 1)), "Last-Event-ID")
    r = httpx.get(f"{server_live.url}/v1/streams/{rid}", params={"after": str(end + 5)})
    _assert_400(r, "Last-Event-ID")
    assert _resume(server_live.url, rid, str(end)).status_code == 200


def test_p3_responses_resume_past_the_last_event_is_a_400(server_live: Any) -> None:
    """P3, Responses: ``starting_after`` / ``Last-Event-ID`` past the last ``sequence_number``
    of a finished response → 400 naming the cursor; a non-numeric ``Last-Event-ID`` → 400
    (not a full replay); the last number itself → 200 with nothing after it."""
    client = openai.OpenAI(base_url=server_live.url + "/v1", api_key="k", max_retries=0)
    events = list(client.responses.create(model=MODEL, input="hi", max_output_tokens=16,
                                          stream=True))
    rid, last = events[-1].response.id, events[-1].sequence_number
    url = f"{server_live.url}/v1/responses/{rid}"
    _assert_400(httpx.get(url, params={"stream": "true", "starting_after": str(last + 1)}),
                "starting_after")
    _assert_400(httpx.get(url, params={"stream": "true"},
                          headers={"Last-Event-ID": str(last + 7)}), "Last-Event-ID")
    _assert_400(httpx.get(url, params={"stream": "true"}, headers={"Last-Event-ID": "abc"}),
                "Last-Event-ID")
    ok = httpx.get(url, params={"stream": "true", "starting_after": str(last)})
    assert ok.status_code == 200 and "data:" not in ok.text, ok.text
    again = httpx.get(url, params={"stream": "true", "starting_after": str(last - 1)})
    assert again.status_code == 200 and f"id: {last}" in again.text, again.text


def test_p3_a_sub_id_past_its_group_is_a_400(server_live: Any) -> None:
    """P3: a group's frames carry ``P.1`` … ``P.(k-1)`` and the last one the plain id, so for
    every base ``P`` a finished message stream (official client) sent and every k up to 5,
    ``P.k`` resumes (200, the rest of its group then the rest of the stream) iff the stream
    sent it, else a 400 naming ``Last-Event-ID`` — before, ``P.k`` past the group silently
    dropped the next event's frames."""
    client = anthropic.Anthropic(base_url=server_live.url, api_key="k", max_retries=0)
    with client.messages.stream(model=MODEL, max_tokens=6,
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        rid = stream.get_final_message().id
    sent = [line[4:] for line in _resume(server_live.url, rid, "-1").text.splitlines()
            if line.startswith("id: ")]
    assert any("." in i for i in sent), sent  # NOTE: message_start's group has sub-ids
    bases = {i.split(".")[0] for i in sent}
    for base in sorted(bases):
        for k in range(1, 6):
            cursor = f"{base}.{k}"
            r = _resume(server_live.url, rid, cursor)
            if cursor in sent:
                assert r.status_code == 200, r.text
                got = [line[4:] for line in r.text.splitlines() if line.startswith("id: ")]
                assert got == sent[sent.index(cursor) + 1:], (cursor, got)
            else:
                _assert_400(r, "Last-Event-ID")


def test_p3_a_live_stream_resumed_past_its_end_is_a_400(server_live: Any) -> None:
    """P3: an id ahead of a stream still running is judged once the log holds it or the
    stream ended: past the terminal → 400 — before, the resume answered at once and, when the
    request ended, sent ``[DONE]`` alone (no terminal chunk: an end it never named)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 400, "ignore_eos": True, "on_disconnect": "continue"}
    with httpx.Client(timeout=60) as h, \
            h.stream("POST", server_live.url + "/v1/chat/completions", json=body) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: {"))
        rid = json.loads(first[6:])["id"]
        resumed = _resume(server_live.url, rid, "100000")
    _assert_400(resumed, "Last-Event-ID")


def test_p3_a_live_response_resumed_past_its_end_is_a_400(server_live: Any) -> None:
    """P3, Responses: ``starting_after`` ahead of a response still running is judged once the
    log holds it or the response ended: past its last ``sequence_number`` → 400."""
    body = {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 400,
            "ignore_eos": True, "background": True}
    with httpx.Client(timeout=60) as h, \
            h.stream("POST", server_live.url + "/v1/responses", json=body) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: {"))
        rid = json.loads(first[6:])["response"]["id"]
        resumed = httpx.get(f"{server_live.url}/v1/responses/{rid}", timeout=60,
                            params={"stream": "true", "starting_after": "100000"})
    _assert_400(resumed, "starting_after")


def test_p3_a_cursor_that_is_no_sequence_number_is_a_400(server_live: Any) -> None:
    """P3: a ``Last-Event-ID`` written otherwise than a stream writes its ids (``--5``, ``+3``,
    ``1_0``, a latin-1 ``²``) is a 400 naming ``Last-Event-ID`` on both resume routes (the
    Responses one through the official client). Before, Python's ``int()`` read them: on
    ``/v1/responses/{id}?stream=true`` ``--5`` and ``²`` passed the digit check and crashed
    the route (the connection reset, no answer), and on ``/v1/streams/{id}`` ``1_0`` resumed
    after event 10 and ``+3`` after 3, ids the stream never sent; a header ``-5`` was a 400
    naming ``starting_after``, a parameter the client never sent."""
    client = openai.OpenAI(base_url=server_live.url + "/v1", api_key="k", max_retries=0)
    rid = list(client.responses.create(model=MODEL, input="hi", max_output_tokens=16,
                                       stream=True))[-1].response.id
    chat, _ = _CHAT.get(server_live.url) or _CHAT.setdefault(
        server_live.url, _chat_stream(server_live.url, 1))
    for cursor in (b"--5", b"+3", b"1_0", b"\xb2", b"-1_0", b"-5"):
        if cursor.isascii():  # NOTE: the SDK sends ASCII header values only
            try:
                client.responses.retrieve(rid, stream=True,
                                          extra_headers={"Last-Event-ID": cursor.decode()})
                raise AssertionError(f"{cursor!r} resumed")
            except openai.BadRequestError as e:
                assert e.body["param"] == "Last-Event-ID", e.body  # type: ignore[index]
        _assert_400(httpx.get(f"{server_live.url}/v1/responses/{rid}", timeout=30,
                              params={"stream": "true"}, headers=[(b"Last-Event-ID", cursor)]),
                    "Last-Event-ID")
        _assert_400(httpx.get(f"{server_live.url}/v1/streams/{chat}", timeout=30,
                              headers=[(b"Last-Event-ID", cursor)]), "Last-Event-ID")
