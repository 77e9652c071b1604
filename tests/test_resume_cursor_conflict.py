"""A resume cursor named twice — query and ``Last-Event-ID`` — never silently picks one (P3).

``GET /v1/responses/{id}?stream=true&starting_after=N`` and ``GET /v1/streams/{id}?after=N``
with a ``Last-Event-ID`` header: equal values resume there; a header ahead of the query
(a browser ``EventSource`` reconnecting to the URL it was opened with) resumes after the
header, so nothing the client holds is sent twice; a header behind the query is a 400
(``invalid_request_error``, ``param`` the query's name, ``code: resume_conflict``). Before,
the query silently won: the reconnect was sent again what it held, and a contradiction
resumed wherever the query said.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.test_server_openai import MODEL


def _ids(text: str) -> list[str]:
    return [line[4:] for line in text.splitlines() if line.startswith("id: ")]


def test_p3_responses_starting_after_and_last_event_id_agree_or_400(server_live: Any) -> None:
    """P3, Responses (official client): header behind ``starting_after`` → 400 naming
    ``starting_after``; equal → resumes there; header ahead → resumes after the header; a
    header that is no sequence number beside a valid query → 400 naming ``Last-Event-ID``."""
    client = openai.OpenAI(base_url=server_live.url + "/v1", api_key="k", max_retries=0)
    rid = list(client.responses.create(model=MODEL, input="hi", max_output_tokens=16,
                                       stream=True))[-1].response.id

    def seqs(after: int, header: str) -> list[int]:
        events = client.responses.retrieve(rid, stream=True, starting_after=after,
                                           extra_headers={"Last-Event-ID": header})
        return [e.sequence_number for e in events]

    with pytest.raises(openai.BadRequestError) as e:
        seqs(3, "1")
    body: Any = e.value.body
    assert (body["param"], body["code"]) == ("starting_after", "resume_conflict"), body
    assert body["type"] == "invalid_request_error", body
    assert seqs(2, "2")[0] == 3
    assert seqs(1, "4")[0] == 5  # NOTE: EventSource's reconnect: the header is newer
    with pytest.raises(openai.BadRequestError) as e:
        seqs(1, "x")
    assert e.value.body["param"] == "Last-Event-ID"  # type: ignore[index]


def test_p3_streams_after_and_last_event_id_agree_or_400(server_live: Any) -> None:
    """P3, ``/v1/streams/{id}`` (a chat streamed through the official client): ``after=``
    with a header behind it → 400 naming ``after``; equal → resumes there; header ahead
    (a sub-id ``P.k`` included) → resumes after the header."""
    client = openai.OpenAI(base_url=server_live.url + "/v1", api_key="k", max_retries=0)
    rid = ""
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}):  # NOTE: a random model may sample EOS first
        rid = chunk.id
    url = f"{server_live.url}/v1/streams/{rid}"
    sent = _ids(httpx.get(url, headers={"Last-Event-ID": "-1"}, timeout=30).text)
    assert len(set(sent[:4])) == 4, sent

    def resume(after: str, header: str) -> httpx.Response:
        return httpx.get(url, params={"after": after}, headers={"Last-Event-ID": header},
                         timeout=30)

    r = resume(sent[3], sent[1])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error", "after", "resume_conflict"), err
    assert _ids(resume(sent[2], sent[2]).text) == sent[3:]
    assert _ids(resume(sent[0], sent[3]).text) == sent[4:]
    sub = next(i for i in sent if "." in i)  # NOTE: the footer's usage chunk: P.1
    assert _ids(resume(sent[0], sub).text) == sent[sent.index(sub) + 1:]
    r = resume(sub, sent[0])
    assert r.status_code == 400 and r.json()["error"]["param"] == "after", r.text
