"""``GET /v1/responses/{id}/input_items`` and ``DELETE /v1/responses/{id}`` with the official
``openai`` client over loopback (issue: the two missing Responses routes; SPEC P1, P2, C1,
L2, L7). The items are what the response was generated from — a string input, a list of
messages, the chain ``previous_response_id`` carried over — each with an id stable between
calls, paged as OpenAI's lists; a deleted response is gone from every route."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace
from typing import Any, cast

import httpx
import openai
import pytest

from tests.test_server_responses import check_responses_stream

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-chat"


def _create(oa: openai.OpenAI, given: Any, **kw: Any) -> Any:
    return oa.responses.create(model=MODEL, input=given, max_output_tokens=16,
                               extra_body={"ignore_eos": True, "seed": 5}, **kw)


def _items(url: str, rid: str, **params: Any) -> httpx.Response:
    return httpx.get(f"{url}/v1/responses/{rid}/input_items", params=params)


def _error(resp: httpx.Response, status: int, param: str | None) -> None:
    """OpenAI's error shape, naming the parameter."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_input_items_string_messages_and_chain_p1(oa: openai.OpenAI, server_live: Any) -> None:
    """A string input is one user message (``input_text``); a list of messages lists as given
    (assistant text as ``output_text``); a continuation lists the carried chain first — the
    previous input items and output message with their ids — then its own input, never the
    instructions; ids are the same on every call; the default order is newest first."""
    one = _create(oa, "hello")
    first = oa.responses.input_items.list(one.id)
    assert [i.model_dump(exclude_none=True) for i in first.data] == [
        {"id": first.data[0].id, "type": "message", "role": "user", "status": "completed",
         "content": [{"type": "input_text", "text": "hello"}]}]
    assert first.data[0].id.startswith("msg_")
    assert oa.responses.input_items.list(one.id).data[0].id == first.data[0].id
    two = _create(oa, [{"role": "developer", "content": "be brief"},
                       {"role": "assistant", "content": "ok"},
                       {"role": "user", "content": [{"type": "input_text", "text": "and?"}]}],
                  previous_response_id=one.id, instructions="Answer briefly.")
    raw = _items(server_live.url, two.id, order="asc").json()
    assert raw["object"] == "list" and raw["has_more"] is False
    got = raw["data"]
    assert [(i["type"], i.get("role")) for i in got] == [
        ("message", "user"), ("message", "assistant"), ("message", "developer"),
        ("message", "assistant"), ("message", "user")]
    assert got[0]["id"] == first.data[0].id  # NOTE: the carried input keeps its id
    assert got[1]["id"] == one.output[0].id  # NOTE: and the previous output its own
    assert got[1]["content"] == [{"type": "output_text", "text": one.output_text,
                                  "annotations": []}]
    assert got[2]["content"] == [{"type": "input_text", "text": "be brief"}]
    assert got[3]["content"] == [{"type": "output_text", "text": "ok", "annotations": []}]
    assert got[4]["content"] == [{"type": "input_text", "text": "and?"}]
    assert len({i["id"] for i in got}) == 5
    assert (raw["first_id"], raw["last_id"]) == (got[0]["id"], got[-1]["id"])
    newest = [i.id for i in oa.responses.input_items.list(two.id).data]
    assert newest == [i["id"] for i in reversed(got)]  # NOTE: desc by default
    assert _items(server_live.url, two.id, order="asc").json() == raw  # NOTE: stable


def test_input_items_tool_items_and_client_ids(oa: openai.OpenAI, server_live: Any) -> None:
    """``function_call`` / ``function_call_output`` items list as such; a client's item id is
    kept, a repeated one (in the input, or of a carried item) replaced, so ids stay unique."""
    one = _create(oa, "hello")
    carried = oa.responses.input_items.list(one.id).data[0].id
    r = _create(oa, [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
         "id": "fc_mine"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "user", "content": "a", "id": "msg_same"},
        {"role": "user", "content": "b", "id": "msg_same"},
        {"role": "user", "content": "c", "id": carried}], previous_response_id=one.id)
    got = _items(server_live.url, r.id, order="asc").json()["data"]
    assert got[2] == {"type": "function_call", "id": "fc_mine", "call_id": "c1", "name": "f",
                      "arguments": "{}", "status": "completed"}
    assert {k: got[3][k] for k in ("type", "call_id", "output")} == {
        "type": "function_call_output", "call_id": "c1", "output": "42"}
    assert got[4]["id"] == "msg_same" and got[0]["id"] == carried
    assert len({i["id"] for i in got}) == len(got) == 7


def test_a_client_id_that_is_a_later_derived_one_stays_unique() -> None:
    """A client id equal to the id a later item would derive: the later one moves aside."""
    from coda.server.responses_items import own_items

    items = own_items("resp_t", [{"role": "user", "content": "a", "id": "msg_t_in1"},
                                 {"role": "user", "content": "b"}], [])
    assert [i["id"] for i in items] == ["msg_t_in1", "msg_t_in1_"]


def test_input_items_pagination_as_openai_lists(oa: openai.OpenAI, server_live: Any) -> None:
    """``limit`` pages, ``after`` continues in the order asked, ``before`` pages back to the
    items nearest it, ``has_more`` says whether items lie beyond; the client's
    auto-pagination walks every item once, in order."""
    r = _create(oa, [{"role": "user", "content": f"m{k}"} for k in range(7)])
    asc = [i["id"] for i in _items(server_live.url, r.id, order="asc", limit=100).json()["data"]]
    assert len(asc) == 7
    walked = [i.id for i in oa.responses.input_items.list(r.id, limit=2, order="asc")]
    assert walked == asc
    assert [i.id for i in oa.responses.input_items.list(r.id, limit=3)] == asc[::-1]
    page = _items(server_live.url, r.id, order="asc", limit=3).json()
    assert [i["id"] for i in page["data"]] == asc[:3] and page["has_more"] is True
    page = _items(server_live.url, r.id, order="asc", limit=3, after=asc[3]).json()
    assert [i["id"] for i in page["data"]] == asc[4:7] and page["has_more"] is False
    assert (page["first_id"], page["last_id"]) == (asc[4], asc[6])
    page = _items(server_live.url, r.id, limit=2, after=asc[4]).json()  # NOTE: desc
    assert [i["id"] for i in page["data"]] == [asc[3], asc[2]] and page["has_more"] is True
    page = _items(server_live.url, r.id, order="asc", limit=2, before=asc[5]).json()
    assert [i["id"] for i in page["data"]] == asc[3:5] and page["has_more"] is True
    page = _items(server_live.url, r.id, order="asc", after=asc[1], before=asc[4]).json()
    assert [i["id"] for i in page["data"]] == asc[2:4] and page["has_more"] is False
    page = _items(server_live.url, r.id, order="asc", after=asc[6]).json()
    assert page == {"object": "list", "data": [], "first_id": None, "last_id": None,
                    "has_more": False}


def test_input_items_errors_in_openai_shape(oa: openai.OpenAI, server_live: Any) -> None:
    """An unknown or unstored id is a 404; a bad ``limit``, ``order``, cursor or ``include``
    a 400 naming it; OpenAI's ``include`` values are accepted."""
    r = _create(oa, "hi")
    unstored = _create(oa, "hi", store=False)
    for rid in ("resp_missing", unstored.id):
        with pytest.raises(openai.NotFoundError):
            oa.responses.input_items.list(rid)
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                          ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "msg_nope"}, "after"), ({"before": "msg_nope"}, "before"),
                          ({"include": "nope"}, "include.0")):
        _error(_items(server_live.url, r.id, **params), 400, param)
    for limit in (1, 100):
        assert len(_items(server_live.url, r.id, limit=limit).json()["data"]) == 1
    with pytest.raises(openai.BadRequestError):
        oa.responses.input_items.list(r.id, limit=0)
    assert len(oa.responses.input_items.list(
        r.id, include=["message.output_text.logprobs"]).data) == 1


def test_delete_forgets_a_response_everywhere_p1(oa: openai.OpenAI, server_live: Any) -> None:
    """Delete answers OpenAI's ``response.deleted`` object; afterwards GET, cancel,
    input_items and a second delete are 404s and ``previous_response_id`` naming it is the
    400 of any unknown id; an unknown id is a 404."""
    r = _create(oa, "hello")
    kept = _create(oa, "other")
    resp = httpx.delete(f"{server_live.url}/v1/responses/{r.id}")
    assert resp.status_code == 200
    assert resp.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    url = f"{server_live.url}/v1/responses/{r.id}"
    for gone in (httpx.get(url), httpx.post(url + "/cancel"), httpx.delete(url),
                 _items(server_live.url, r.id)):
        assert gone.status_code == 404
        assert gone.json()["error"]["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        oa.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as err:
        _create(oa, "more", previous_response_id=r.id)
    assert err.value.status_code == 400
    assert cast(dict[str, Any], err.value.body)["param"] == "previous_response_id"
    assert oa.responses.delete(kept.id) is None  # NOTE: the SDK's answer to a 200
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(kept.id)


def test_store_delete_answers_true_once() -> None:
    """The in-memory store: of two deletes of one record exactly one answers True (the
    route's 404 for the loser of a race), and the record is gone."""
    from coda.server.records import Record, RecordStore

    store = RecordStore(4)
    store.put(cast(Record, SimpleNamespace(id="resp_1", done=True)))
    assert store.delete("resp_1") is True
    assert store.delete("resp_1") is False and store.get("resp_1") is None


def _read_stream(url: str, out: list[dict[str, Any]]) -> None:
    acc: dict[str, str] = {}
    with httpx.stream("GET", url, params={"stream": "true"}, timeout=60) as resp:
        for line in resp.iter_lines():
            if not line:
                if "data" in acc:
                    out.append(dict(acc))
                acc = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(":")
                acc[key] = value.strip()


def test_delete_running_background_cancels_once_l7_l2_c1(
        oa: openai.OpenAI, server_live: Any, server_settle: Any) -> None:
    """A running background response deleted (twice at once: one 200, one 404): cancelled
    first (C1), the attached reader's
    stream ends with its one terminal (L2, P2: ``cancelled``), the record is gone, and the
    engine ends idle with every KV block free (L7: released once, on the cancel path)."""
    bg = oa.responses.create(model=MODEL, input="Hello", max_output_tokens=400,
                             background=True, extra_body={"ignore_eos": True})
    events: list[dict[str, Any]] = []
    reader = threading.Thread(target=_read_stream,
                              args=(f"{server_live.url}/v1/responses/{bg.id}", events))
    reader.start()
    deadline = time.monotonic() + 10
    while not any(e.get("event") == "response.output_text.delta" for e in events):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    codes: list[int] = []
    url = f"{server_live.url}/v1/responses/{bg.id}"
    deleters = [threading.Thread(target=lambda: codes.append(httpx.delete(url).status_code))
                for _ in range(2)]
    for t in deleters:
        t.start()
    for t in deleters:
        t.join(30)
    assert sorted(codes) == [200, 404]  # NOTE: two racing deletes: one deletes it
    reader.join(30)
    assert not reader.is_alive()
    check_responses_stream(events)  # NOTE: exactly one terminal, last
    final = json.loads(events[-1]["data"])["response"]
    assert final["status"] == "cancelled"
    assert final["coda"]["finish_reason"] == "cancelled"
    assert final["usage"]["output_tokens"] < 400
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(bg.id)
    stats = server_settle()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_delete_running_foreground_stream_ends_once_l2(
        oa: openai.OpenAI, server_live: Any, server_settle: Any) -> None:
    """The creating client's own stream, deleted from elsewhere mid-way, ends once with the
    cancelled terminal; nothing is left allocated (L7)."""
    with oa.responses.create(model=MODEL, input="Hello", max_output_tokens=400, stream=True,
                             extra_body={"ignore_eos": True}) as stream:
        kinds, rid = [], ""
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.created":
                rid = ev.response.id
            if ev.type == "response.output_text.delta" and kinds.count(ev.type) == 2:
                assert oa.responses.delete(rid) is None
    finals = [k for k in kinds if k in ("response.completed", "response.incomplete",
                                        "response.failed")]
    assert len(finals) == 1 and kinds[-1] == finals[0]
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(rid)
    stats = server_settle()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
