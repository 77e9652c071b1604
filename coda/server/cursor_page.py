"""OpenAI's cursor lists (SPEC P1): the query a list route reads (``after`` / ``before`` /
``limit`` / ``order``) and one page of its items as ``{"object": "list", "data", "first_id",
"last_id", "has_more"}``. One home for the Responses input items
(:mod:`coda.server.responses_items`) and the stored chat completions and their messages
(:mod:`coda.server.chat_store`).

``limit`` is 1–100 (default 20); ``order`` ``asc`` or ``desc`` (each route's own default);
``after`` / ``before`` name an item of the list (an id not in it is a 400 naming the cursor);
``before`` alone pages backwards (the ``limit`` items nearest the cursor); ``has_more`` says
whether items lie beyond the page in the direction of travel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coda.server.http_errors import ApiError

__all__ = ["one", "page", "page_query"]


def one(query: Mapping[str, list[str]], name: str) -> str | None:
    """The query parameter ``name`` given at most once (twice is a 400 naming it)."""
    values = query.get(name, [])
    if len(values) > 1:
        raise ApiError(400, f"{name}: give it once", param=name)
    return values[0] if values else None


def page_query(query: Mapping[str, list[str]], default_order: str
               ) -> tuple[str | None, str | None, int, str]:
    """``(after, before, limit, order)`` of a list request; a bad value is a 400 naming it."""
    raw = one(query, "limit")
    limit = 20 if raw is None else (int(raw) if raw.strip().lstrip("-").isdigit() else 0)
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit: must be an integer from 1 to 100, not {raw!r}",
                       param="limit")
    order = one(query, "order") or default_order
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order: must be 'asc' or 'desc', not {order!r}", param="order")
    return one(query, "after"), one(query, "before"), limit, order


def _at(ids: list[str], cursor: str | None, name: str, what: str) -> int | None:
    if cursor is None:
        return None
    if cursor not in ids:
        raise ApiError(400, f"{name}: no {what} '{cursor}' in this list", param=name)
    return ids.index(cursor)


def page(items: Sequence[Mapping[str, Any]], *, after: str | None, before: str | None,
         limit: int, order: str, what: str) -> dict[str, Any]:
    """One page of ``items`` (stored oldest first) as OpenAI's list object; ``what`` names an
    item in a bad cursor's 400."""
    ordered = [dict(i) for i in (items if order == "asc" else reversed(items))]
    ids = [str(i["id"]) for i in ordered]
    lo, hi = _at(ids, after, "after", what), _at(ids, before, "before", what)
    window = ordered[(0 if lo is None else lo + 1):(len(ordered) if hi is None else hi)]
    if before is not None and after is None:
        # NOTE: ``before`` alone pages backwards: the ``limit`` items nearest the cursor
        data, more = window[-limit:], len(window) > limit
    else:
        data, more = window[:limit], len(window) > limit
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
