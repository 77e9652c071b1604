"""A replay from another front end on the same Redis (or from the same server restarted) is
the original stream byte for byte, its terminal's ``coda.timings.network_send_s`` included
(SPEC P3, P5; docs/api.md "Streams": the first delivery's send time, "recorded once and shown
unchanged by every replay"). Before, only the ingress that delivered it first held that value
in memory: every other front end rendered its own replay's send time. Real redis-server, real
uvicorn, the official ``openai`` and ``anthropic`` clients for the first delivery."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from coda.server.durable import ServerDurable
from tests.redis_support import RedisServer, running_redis

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


def _send_times(replay: str) -> dict[int, float]:
    """The ``network_send_s`` of each choice's terminal frame in an SSE replay."""
    out: dict[int, float] = {}
    for line in replay.splitlines():
        if line.startswith("data: {"):
            data = json.loads(line[6:])
            codas = [c.get("coda") for c in data.get("choices") or []] + [data.get("coda")]
            out |= {c.get("index", 0): c["timings"]["network_send_s"] for c in codas
                    if c and "network_send_s" in c.get("timings", {})}
    return out


def _per_choice(replay: str) -> dict[int, list[str]]:
    """Each choice's frames (data lines) of an SSE replay, in order."""
    out: dict[int, list[str]] = {}
    for line in replay.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:]).get("choices") or []:
                out.setdefault(c["index"], []).append(json.dumps(c, sort_keys=True))
    return out


def test_p3_p5_a_replay_on_another_front_end_equals_the_first_delivery_byte_for_byte(
        server_spawn: Any, redis_server: RedisServer, server_settle: Any) -> None:
    """P3/P5: chat (include_usage) and Messages streams delivered by ingress A; their full
    replays from A and from B (a second front end on the Redis: what a restarted server is)
    are identical, the terminal carrying A's recorded send time; with n = 2 each choice's
    terminal carries A's value for that choice."""
    a = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2))
    b = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2))
    oa = openai.OpenAI(base_url=a.url + "/v1", api_key="k", max_retries=0)
    an = anthropic.Anthropic(base_url=a.url, api_key="k", max_retries=0)
    chats = [list(oa.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hello"}], n=n,
        max_tokens=12, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "seed": 3}))[0].id for n in (1, 2)]
    with an.messages.stream(model="tiny-chat", max_tokens=12,
                            messages=[{"role": "user", "content": "hello"}],
                            extra_body={"ignore_eos": True}) as stream:
        message = stream.get_final_message()
    with httpx.Client(timeout=60) as client:
        for rid, n in ((chats[0], 1), (message.id, 1), (chats[1], 2)):
            first = client.get(f"{a.url}/v1/streams/{rid}")
            other = client.get(f"{b.url}/v1/streams/{rid}")
            again = client.get(f"{b.url}/v1/streams/{rid}")
            assert first.status_code == other.status_code == 200
            assert len(_send_times(first.text)) == n
            assert _send_times(other.text) == _send_times(first.text)
            assert _per_choice(other.text) == _per_choice(first.text)
            # NOTE: n > 1 too: the log keeps the merge order (tests/test_durable_merge_order.py)
            assert other.text == first.text == again.text
    server_settle()
