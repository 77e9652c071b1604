"""``previous_response_id`` through any front end (issue 24 item 3; SPEC P1): a stored response
continues on another front end sharing the Redis log — the continuation's prompt is the first
turn's input and output plus the new input, exactly what one in-memory front end builds for the
same conversation (same prompt tokens, same seed: the same output) — and both front ends
``GET`` it. Without ``--redis-url`` the conversation lives in the front end's memory. Tested
with the official ``openai`` client over loopback, real redis-server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, cast

import openai
import pytest

from coda.server.durable import ServerDurable
from tests.redis_support import RedisServer, running_redis

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _turn(client: openai.OpenAI, text: str, prev: str | None = None, **kw: Any) -> Any:
    return client.responses.create(model=MODEL, input=text, store=True, max_output_tokens=16,
                                   previous_response_id=prev or openai.NOT_GIVEN,
                                   extra_body={"ignore_eos": True, "seed": 11}, **kw)


def test_a_conversation_continues_on_another_front_end_p1(
        server_spawn: Any, server_live: Any, redis_server: RedisServer) -> None:
    """Turn 1 on A, turn 2 on B (previous_response_id = turn 1), turn 3 on A (= turn 2, which
    only B stored): each equals the same conversation held by one in-memory front end (the
    oracle) in prompt tokens and output; each is retrievable on both front ends; the
    continuation's prompt is longer than the bare new input by at least the first turn."""
    a = _client(server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2)).url)
    b = _client(server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2)).url)
    mem = _client(server_live.url)
    one, m_one = _turn(a, "hello"), _turn(mem, "hello")
    two, m_two = _turn(b, "and then?", one.id), _turn(mem, "and then?", m_one.id)
    three, m_three = _turn(a, "again", two.id), _turn(mem, "again", m_two.id)
    for got, want in ((one, m_one), (two, m_two), (three, m_three)):
        assert got.status == want.status == "incomplete"  # max_output_tokens, ignore_eos
        assert got.usage.input_tokens == want.usage.input_tokens
        assert got.output_text == want.output_text
    bare = _turn(mem, "and then?")
    assert two.usage.input_tokens >= (bare.usage.input_tokens + one.usage.input_tokens
                                      + one.usage.output_tokens - 8)  # NOTE: one template
    assert three.usage.input_tokens > two.usage.input_tokens + two.usage.output_tokens
    for front in (a, b):
        for resp in (one, two, three):
            again = front.responses.retrieve(resp.id)
            assert again.output_text == resp.output_text and again.id == resp.id
    # NOTE: the new request's instructions replace the previous ones; none are inherited
    told = _turn(b, "and then?", one.id, instructions="Answer briefly.")
    m_told = _turn(mem, "and then?", m_one.id, instructions="Answer briefly.")
    assert told.usage.input_tokens == m_told.usage.input_tokens > two.usage.input_tokens


def test_unknown_or_unstored_previous_response_is_a_400(
        server_spawn: Any, redis_server: RedisServer) -> None:
    b = _client(server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2)).url)
    unstored = b.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=16)
    for prev in ("resp_doesnotexist", unstored.id):
        with pytest.raises(openai.BadRequestError) as err:
            _turn(b, "more", prev)
        assert err.value.status_code == 400
        assert cast(dict[str, Any], err.value.body)["param"] == "previous_response_id"


def test_delete_is_durable_on_every_front_end_p1(
        server_spawn: Any, redis_server: RedisServer) -> None:
    """DELETE on A (``--redis-url``): B, which held the response in memory, and C, a front end
    started afterwards (a restart), answer 404 for it (GET, input_items, delete) and 400 for
    ``previous_response_id`` naming it; before that, B listed the same input items, ids
    included, as A (they travel in the log); a second delete anywhere is a 404."""
    def spawn() -> openai.OpenAI:
        return _client(server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2)).url)

    a, b = spawn(), spawn()
    one = _turn(a, "hello")
    two = _turn(b, "and then?", one.id)
    listed = [i.id for i in a.responses.input_items.list(two.id)]
    assert [i.id for i in b.responses.input_items.list(two.id)] == listed and len(listed) == 3
    assert b.responses.retrieve(one.id).id == one.id  # NOTE: B now holds it in memory
    assert a.responses.delete(one.id) is None
    c = spawn()
    for front in (a, b, c):
        with pytest.raises(openai.NotFoundError):
            front.responses.retrieve(one.id)
        with pytest.raises(openai.NotFoundError):
            front.responses.input_items.list(one.id)
        with pytest.raises(openai.NotFoundError):
            front.responses.delete(one.id)
        with pytest.raises(openai.BadRequestError):
            _turn(front, "more", one.id)
    assert redis_server.client.exists(f"coda:rec:{{{one.id}}}") == 0
    # NOTE: the continuation stays, with the chain it was generated from
    assert [i.id for i in c.responses.input_items.list(two.id)] == listed


def test_record_delete_answers_true_once_across_front_ends(redis_server: RedisServer) -> None:
    """Two front ends deleting one descriptor at once: the log answers True to exactly one
    (the other's DELETE is a 404), and the record is gone for both."""
    from coda.durable.redis_log import RedisStreamLog

    logs = [RedisStreamLog(redis_server.url, prefix="del:") for _ in range(2)]
    for n in range(20):
        rid = f"resp_{n}"
        logs[0].put_record(rid, {"handles": []})
        answers: list[bool] = []
        racers = [threading.Thread(target=lambda log=log, out=answers, rid=rid: out.append(
            log.delete_record(rid))) for log in logs]
        for t in racers:
            t.start()
        for t in racers:
            t.join()
        assert sorted(answers) == [False, True]
        assert not logs[0].has_record(rid) and not logs[1].has_record(rid)
