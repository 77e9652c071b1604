"""``client.models.list()`` pages as Anthropic's does (SPEC P1), through the official
``anthropic`` client over loopback, on three served models (described, never loaded): ``limit``
models after ``after_id`` or before ``before_id``, ``has_more`` saying whether more lie beyond
(the query was ignored: ``limit=1`` gave every model with ``has_more`` false); a bad ``limit``
or an id the list does not hold is a 400 naming it; the SDK's auto-pagination walks them all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from coda.engine.types import EngineConfig
from coda.server.model_router import build_router
from coda.server.model_specs import ModelSpec
from tests.conftest import LiveServer

NAMES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def client() -> Iterator[anthropic.Anthropic]:
    from coda.server.app import create_app

    router = build_router([ModelSpec(None, n) for n in NAMES],
                          EngineConfig(max_num_seqs=2, kv_cache_bytes=8 << 20))
    server = LiveServer(create_app(router)).start()
    try:
        yield anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
    finally:
        server.stop()


def _page(client: anthropic.Anthropic, **query: Any) -> tuple[list[str], bool, Any, Any]:
    page = client.models.list(**query)
    return [m.id for m in page.data], bool(page.has_more), page.first_id, page.last_id


def test_p1_models_list_pages_by_limit_and_cursor(client: anthropic.Anthropic) -> None:
    """P1: each page is ``limit`` models from its cursor, ``has_more`` true while more lie
    beyond it; ``first_id`` / ``last_id`` are the page's."""
    assert _page(client) == (NAMES, False, "a", "c")
    assert _page(client, limit=1) == (["a"], True, "a", "a")
    assert _page(client, limit=1, after_id="a") == (["b"], True, "b", "b")
    assert _page(client, limit=2, after_id="a") == (["b", "c"], False, "b", "c")
    assert _page(client, after_id="c") == ([], False, None, None)
    assert _page(client, limit=1, before_id="c") == (["b"], True, "b", "b")
    assert _page(client, limit=5, before_id="c") == (["a", "b"], False, "a", "b")
    walked = [m.id for m in client.models.list(limit=1)]  # NOTE: the SDK follows last_id
    assert walked == NAMES


@pytest.mark.parametrize(("query", "field"), [
    ({"limit": 0}, "limit"), ({"limit": 1001}, "limit"),
    ({"after_id": "nope"}, "after_id"), ({"before_id": "nope"}, "before_id"),
    ({"after_id": "a", "before_id": "c"}, "before_id"),
])
def test_p1_models_list_bad_query_is_a_400(client: anthropic.Anthropic, query: Any,
                                           field: str) -> None:
    """P1: a 400 ``invalid_request_error`` naming the query field, never a page."""
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.models.list(**query)
    body: Any = exc.value.body
    assert body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"].startswith(field + ":"), body
