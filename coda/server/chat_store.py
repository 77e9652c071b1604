"""Stored chat completions (OpenAI's ``store: true`` on Chat Completions; SPEC P1): what a
stored completion keeps, and the pages its routes answer (:mod:`coda.server.chat_store_routes`).

A chat completion created with ``store: true`` keeps, on its record's spec
(:class:`~coda.server.render_spec.OpenAIRender`), ``stored``, its ``metadata`` and the request's
``messages`` as sent. The record itself — the engine streams, in the server's one
:class:`~coda.server.state.ResponseStore` beside stored responses — is the completion: a
retrieve renders the same non-streamed object the create answered (a streamed one assembled
from its events), so nothing is copied. With ``--redis-url`` the spec is the record's
descriptor in the stream log, so any front end on that Redis retrieves, updates and deletes it;
a list shows the stored completions this front end holds.

``store`` omitted keeps a completion for ``/v1/streams`` resume only (not retrievable here, as
OpenAI's default ``store: false``); ``store: false`` drops it once it ended (docs/api.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coda.server.http_errors import ApiError
from coda.server.render_spec import OpenAIRender
from coda.server.schemas import ChatCompletionRequest
from coda.server.state import Record


def stored_fields(body: ChatCompletionRequest) -> dict[str, Any]:
    """The spec fields of a ``store: true`` chat completion: the flag, its metadata and the
    request's messages as plain data (as the client sent them, nulls left out)."""
    return {"stored": True, "metadata": dict(body.metadata or {}),
            "messages": tuple(m.model_dump(mode="json", exclude_none=True)
                              for m in body.messages)}


def is_stored(record: Record | None) -> bool:
    """A chat completion created with ``store: true`` (what the chat routes may serve)."""
    return (record is not None and record.kind == "chat"
            and isinstance(record.spec, OpenAIRender) and record.spec.stored)


def not_found(cid: str) -> ApiError:
    return ApiError(404, f"No chat completion found with id '{cid}'. Only completions "
                         "created with store: true are stored.", param="completion_id",
                    code="not_found")


def store_message(cid: str, index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """A request message as OpenAI's ``ChatCompletionStoreMessage``: an ``id``, the role, the
    content as text (parts joined) with the parts themselves in ``content_parts``."""
    content = message.get("content")
    parts = content if isinstance(content, list) else None
    text = ("".join(str(p.get("text", "")) for p in parts if isinstance(p, Mapping))
            if parts is not None else content)
    out: dict[str, Any] = {"id": f"{cid}-{index}", "role": message.get("role"),
                           "content": text, "content_parts": parts, "refusal": None}
    for key in ("name", "tool_calls", "tool_call_id", "function_call"):
        if key in message:
            out[key] = message[key]
    return out


def _one(query: Mapping[str, list[str]], name: str) -> str | None:
    values = query.get(name, [])
    if len(values) > 1:
        raise ApiError(400, f"{name}: given more than once", param=name)
    return values[0] if values else None


def list_query(query: Mapping[str, list[str]]) -> tuple[str | None, int, str]:
    """``(after, limit, order)`` of a list request: ``limit`` 1 to 100 (default 20), ``order``
    ``asc`` (OpenAI's default here) or ``desc``; a bad value is a 400 naming it."""
    raw = _one(query, "limit")
    limit = 20 if raw is None else (int(raw) if raw.strip().lstrip("-").isdigit() else 0)
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit: must be an integer from 1 to 100, not {raw!r}",
                       param="limit")
    order = _one(query, "order") or "asc"
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order: must be 'asc' or 'desc', not {order!r}", param="order")
    return _one(query, "after"), limit, order


def metadata_filter(query: Mapping[str, list[str]]) -> dict[str, str]:
    """``metadata[key]=value`` pairs of the list query (the SDK's form of ``metadata=``)."""
    out: dict[str, str] = {}
    for name in query:
        if name.startswith("metadata[") and name.endswith("]"):
            value = _one(query, name)
            out[name[len("metadata["):-1]] = value or ""
    return out


def page(items: Sequence[dict[str, Any]], *, after: str | None, limit: int, order: str,
         what: str) -> dict[str, Any]:
    """One page of ``items`` (oldest first) as OpenAI's cursor list; ``after`` names the last
    item of the previous page (an id not in the list is a 400 naming ``after``)."""
    ordered = list(items if order == "asc" else reversed(items))
    start = 0
    if after is not None:
        ids = [i["id"] for i in ordered]
        if after not in ids:
            raise ApiError(400, f"after: no {what} with id '{after}'", param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(ordered) > start + limit}
