"""``GET /v1/models`` and ``GET /v1/models/{id}`` in Anthropic's shape (SPEC P1), for a request
that carries the ``anthropic-version`` header (every Anthropic SDK sends it: its
``client.models.list()`` / ``.retrieve()``); an OpenAI client sends none and keeps OpenAI's
shape (``coda.server.app``).

A model is ``{"type": "model", "id", "display_name", "created_at"}`` (RFC 3339: the card's
``created``, the checkpoint's last change; the epoch where it is unknown), plus
``lifecycle: "active"`` and ``max_input_tokens`` (the served context length) where known; the
list is ``{"data", "has_more", "first_id", "last_id"}``, one page. An unknown id is
Anthropic's 404 ``not_found_error``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from coda.server.http_errors import error_response


def wants_anthropic(request: Request) -> bool:
    """The request came from an Anthropic client (its ``anthropic-version`` header)."""
    return "anthropic-version" in request.headers


def _created(card: Mapping[str, Any]) -> str:
    stamp = card.get("created") or 0
    return datetime.fromtimestamp(int(stamp), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def model_info(card: Mapping[str, Any]) -> dict[str, Any]:
    """One OpenAI-shaped model card as Anthropic's ``ModelInfo``."""
    out: dict[str, Any] = {"type": "model", "id": card["id"], "display_name": card["id"],
                           "created_at": _created(card), "lifecycle": "active"}
    if isinstance(card.get("max_model_len"), int):
        out["max_input_tokens"] = card["max_model_len"]
    return out


_LIMIT, _MAX_LIMIT = 20, 1000  # NOTE: Anthropic's default page size and its bound


def _bad(field: str, what: str) -> JSONResponse:
    return error_response("anthropic", 400, f"{field}: {what}")


def model_list(cards: Sequence[Mapping[str, Any]],
               query: Mapping[str, str] | None = None) -> JSONResponse:
    """One page of the models (module doc); ``query`` is the request's query string."""
    q = query or {}
    data = [model_info(c) for c in cards]
    raw = q.get("limit")
    try:
        limit = _LIMIT if raw is None else int(raw)
    except ValueError:
        return _bad("limit", f"Input should be a valid integer (got {raw!r})")
    if not 1 <= limit <= _MAX_LIMIT:
        return _bad("limit", f"must be from 1 to {_MAX_LIMIT} (got {limit})")
    after, before = q.get("after_id"), q.get("before_id")
    if after is not None and before is not None:
        return _bad("before_id", "cannot be combined with after_id: page one way")
    ids = [m["id"] for m in data]
    for name, cursor in (("after_id", after), ("before_id", before)):
        if cursor is not None and cursor not in ids:
            return _bad(name, f"no model {cursor!r} in this list")
    if before is not None:
        end = ids.index(before)
        page, more = data[max(0, end - limit):end], end > limit
    else:
        start = ids.index(after) + 1 if after is not None else 0
        page, more = data[start:start + limit], start + limit < len(data)
    return JSONResponse({"data": page, "has_more": more,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None})


def not_found(status: int, message: str) -> JSONResponse:
    """The model check's error (its 404), in Anthropic's shape (``not_found_error``)."""
    return error_response("anthropic", status, message)
