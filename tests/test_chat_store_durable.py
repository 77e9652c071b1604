"""Stored chat completions through any front end on one Redis log (``--redis-url``; SPEC P1,
P3): a ``store: true`` completion created on A is retrieved, its messages listed and its
metadata updated on B; the update is seen on A, which held it in memory; a delete on A is a
404 on B and on C, a front end started afterwards; the list on any front end shows every
front end's stored completions, filtered and paged alike. Official ``openai`` client over
loopback, real redis-server (the tiny test model)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from coda.server.durable import ServerDurable
from tests.redis_support import RedisServer, running_redis

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


def test_p1_p3_stored_chat_completion_on_every_front_end(
        server_spawn: Any, redis_server: RedisServer) -> None:
    """P1, P3: retrieve / messages / update on B of A's stored completion; A sees B's update;
    after A's delete, A, B and a new C answer 404; the descriptor has left the log."""
    def spawn() -> openai.OpenAI:
        url = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2)).url
        return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    a, b = spawn(), spawn()
    made = a.chat.completions.create(model="tiny-chat", max_tokens=8, store=True,
                                     messages=[{"role": "user", "content": "hello"}],
                                     metadata={"run": "a"}, extra_body={"seed": 5})
    assert a.chat.completions.retrieve(made.id).metadata == {"run": "a"}  # NOTE: A holds it
    got = b.chat.completions.retrieve(made.id)
    assert got.choices[0].message.content == made.choices[0].message.content
    assert got.metadata == {"run": "a"}
    assert [m.content for m in b.chat.completions.messages.list(made.id)] == ["hello"]
    assert b.chat.completions.update(made.id, metadata={"run": "b"}).metadata == {"run": "b"}
    assert a.chat.completions.retrieve(made.id).metadata == {"run": "b"}
    assert a.chat.completions.delete(made.id).deleted
    c = spawn()
    for front in (a, b, c):
        with pytest.raises(openai.NotFoundError):
            front.chat.completions.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            front.chat.completions.delete(made.id)
    assert redis_server.client.exists(f"coda:rec:{{{made.id}}}") == 0


def test_p1_p3_stored_chat_completions_list_on_every_front_end(
        server_spawn: Any, redis_server: RedisServer) -> None:
    """P1, P3: ``client.chat.completions.list`` on any front end shows the stored completions
    of every front end on the log, oldest first, filtered by ``model`` / ``metadata``, paged
    by ``after`` / ``limit`` / ``order`` alike on each (it showed only the records the
    answering front end held); an update or a delete on one is seen by every list."""
    def spawn() -> openai.OpenAI:
        url = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2)).url
        return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    fronts = [spawn(), spawn(), spawn()]
    tag = {"suite": "list"}
    ids, model = [], ""
    for i in range(5):
        made = fronts[i % 3].chat.completions.create(
            model="tiny-chat", max_tokens=4, store=True, metadata={**tag, "n": str(i)},
            messages=[{"role": "user", "content": f"hi {i}"}], extra_body={"seed": i})
        ids.append(made.id)
        model = made.model
    fronts[0].chat.completions.create(model="tiny-chat", max_tokens=4,  # NOTE: not stored
                                      messages=[{"role": "user", "content": "no"}])
    late = spawn()  # NOTE: started after every create: it holds none of them
    for front in (*fronts, late):
        assert [c.id for c in front.chat.completions.list(metadata=tag)] == ids
        assert [c.id for c in front.chat.completions.list(metadata=tag, limit=2)] == ids
        assert [c.id for c in front.chat.completions.list(
            metadata=tag, order="desc")] == ids[::-1]
        assert [c.id for c in front.chat.completions.list(model=model, metadata=tag)] == ids
        assert [c.id for c in front.chat.completions.list(model="no-such-model")] == []
    first = late.chat.completions.list(metadata=tag, limit=2)
    assert [c.id for c in first.data] == ids[:2] and first.has_more
    second = fronts[1].chat.completions.list(metadata=tag, limit=2, after=ids[1])
    assert [c.id for c in second.data] == ids[2:4] and second.has_more
    last = fronts[2].chat.completions.list(metadata=tag, limit=2, after=ids[3])
    assert [c.id for c in last.data] == ids[4:] and not last.has_more
    newest = fronts[0].chat.completions.list(metadata=tag, limit=2, order="desc")
    assert [c.id for c in newest.data] == [ids[4], ids[3]]
    listed = {c.id: c for c in late.chat.completions.list(metadata=tag)}
    assert listed[ids[1]].metadata == {**tag, "n": "1"}
    assert listed[ids[1]].choices[0].message.content == (
        fronts[1].chat.completions.retrieve(ids[1]).choices[0].message.content)
    fronts[2].chat.completions.update(ids[1], metadata={**tag, "n": "x"})
    for front in (fronts[0], late):
        assert [c.id for c in front.chat.completions.list(metadata={"n": "x"})] == [ids[1]]
    assert fronts[1].chat.completions.delete(ids[0]).deleted
    for front in (*fronts, late):
        assert [c.id for c in front.chat.completions.list(metadata=tag)] == ids[1:]
