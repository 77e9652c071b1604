"""Merge order of an n > 1 stream over replicas survives the durable log (SPEC P3; docs/api.md
"Streams", docs/scale-out.md "The durable log"): with ``--replicas`` and ``--redis-url`` the
replicas write the log, each run with its merge key (``m``), and forward their durable copies
to the ingress; the ingress's first delivery of an n = 3 stream is captured byte for byte and
a replay from every cut point served by a second ingress on the same Redis (rebuilt from the
log) is exactly the first delivery's bytes after that cut. Before, the feed carried no keys:
the ingress merged the choices as their messages arrived and a replay interleaved them by
the log's keys (other ids, other bytes). The session's two replicas (two sequences each, so
the three choices run on both replicas, or one waits) and one redis-server for the module."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("ray")

from tests.redis_support import RedisServer, running_redis  # noqa: E402
from tests.scaleout_support import ingress  # noqa: E402
from tests.test_durable_merge_order import _expected, _frames, _id, _replay  # noqa: E402

pytestmark = pytest.mark.timeout(300)
LEASE_S = 2.0


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


def _first_delivery(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[str, bytes]:
    with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        return resp.headers["x-request-id"], b"".join(resp.iter_raw())


def test_p3_n3_over_replicas_replay_from_every_cut_on_another_ingress_is_the_first_delivery(
        replicas: Any, redis_server: RedisServer) -> None:
    """P3: n = 3 streamed chats (include_usage: the footer's sub-id ``P.k``) through ingress
    A over two replicas; B's replay from the start and after every id A sent is A's bytes
    after that id. A few requests with other seeds, so the choices land on both replicas
    and the interleaving is not one lucky order."""
    a, _ = ingress(replicas, redis_server.url, LEASE_S)
    b, _ = ingress(replicas, redis_server.url, LEASE_S)
    try:
        with httpx.Client(timeout=120) as client:
            for seed in (5, 6, 7):
                body = {"model": replicas.model_name, "n": 3, "stream": True,
                        "max_tokens": 12, "ignore_eos": True, "seed": seed,
                        "stream_options": {"include_usage": True},
                        "messages": [{"role": "user", "content": f"hello {seed}"}]}
                rid, first = _first_delivery(client, a.url, body)
                frames = _frames(first)
                ids = [i for f in frames if (i := _id(f)) is not None]
                assert len(ids) == len(frames) and all(i.count(",") == 2 for i in ids)
                order = [c["index"] for f in frames if b'"choices":[{' in f
                         for c in json.loads(f.split(b"data: ", 1)[1])["choices"]]
                assert sorted(set(order)) == [0, 1, 2]
                for cut in [None, *dict.fromkeys(ids)]:
                    assert _replay(client, b.url, rid, cut) == _expected(frames, cut), (seed,
                                                                                      cut)
    finally:
        a.stop()
        b.stop()
