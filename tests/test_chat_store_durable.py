"""Stored chat completions through any front end on one Redis log (``--redis-url``; SPEC P1,
P3): a ``store: true`` completion created on A is retrieved, its messages listed and its
metadata updated on B; the update is seen on A, which held it in memory; a delete on A is a
404 on B and on C, a front end started afterwards. Official ``openai`` client over loopback,
real redis-server (the tiny test model)."""

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
