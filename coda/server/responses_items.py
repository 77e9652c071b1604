"""A stored response's input items, as ``GET /v1/responses/{id}/input_items`` lists them
(OpenAI's ``ResponseItemList``): built once when the response is created, each with an id, and
kept on its :class:`~coda.server.render_spec.ResponsesRender` (so the Redis log carries them to
every front end and the ids never change between calls).

What is listed is what the response was generated from, as OpenAI lists it: with
``previous_response_id`` the items the chain carried over (the previous response's own input
items, then its output message and function calls, keeping their ids), then the request's own
input; ``instructions`` are not an item. A string input is one ``user`` message with one
``input_text`` part.

Pagination (:func:`page`) is OpenAI's cursor list: ``order`` ``desc`` (default: newest first)
or ``asc``; ``after`` / ``before`` name an item of the list; ``limit`` 1–100 (default 20);
``has_more`` says whether items lie beyond the page in the direction of travel.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, get_args

from coda.server.common import new_id
from coda.server.http_errors import ApiError
from coda.server.protocol_schemas import InputMessage, InputToolItem, ResponseIncludable

__all__ = ["carried_items", "own_items", "page", "parse_query"]

Item = dict[str, Any]
_INCLUDABLE = frozenset(get_args(ResponseIncludable))


def _text_part(role: str, text: str) -> dict[str, Any]:
    if role == "assistant":  # NOTE: an assistant message lists as output text, as OpenAI's
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def _fresh(given: object, prefix: str, taken: set[str]) -> str:
    """The client's own id if it gave an unused one, else a new one (ids are unique in a
    list, so ``after`` / ``before`` name one item)."""
    rid = given if isinstance(given, str) and given and given not in taken else new_id(prefix)
    taken.add(rid)
    return rid


def own_items(given: str | Sequence[InputMessage | InputToolItem],
              carried: Sequence[Mapping[str, Any]]) -> list[Item]:
    """The request's ``input`` as listed items, ids unique beside the ``carried`` ones."""
    taken = {str(i.get("id")) for i in carried}
    if isinstance(given, str):
        return [{"type": "message", "id": _fresh(None, "msg_", taken), "role": "user",
                 "status": "completed", "content": [_text_part("user", given)]}]
    out: list[Item] = []
    for item in given:
        extra = item.model_extra or {}
        if isinstance(item, InputToolItem):
            body: Item = ({"call_id": item.call_id, "name": item.name,
                           "arguments": item.arguments or ""}
                          if item.type == "function_call"
                          else {"call_id": item.call_id, "output": item.output})
            prefix = "fc_" if item.type == "function_call" else "fco_"
            out.append({"type": item.type, "id": _fresh(extra.get("id"), prefix, taken),
                        **body, "status": "completed"})
            continue
        content = ([_text_part(item.role, item.content)] if isinstance(item.content, str)
                   else [dict(p) for p in item.content])
        out.append({"type": "message", "id": _fresh(extra.get("id"), "msg_", taken),
                    "role": item.role, "status": "completed", "content": content})
    return out


def carried_items(previous: Iterable[Mapping[str, Any]],
                  output: Iterable[Mapping[str, Any]]) -> list[Item]:
    """What a continuation of a response carries over: that response's listed items, then
    its output message and function calls (what :mod:`coda.server.responses_history` feeds
    the model), with their ids; a message's logprobs are left out."""
    out = [dict(i) for i in previous]
    for item in output:
        if item.get("type") == "message":
            parts = [{"type": "output_text", "text": p.get("text", ""), "annotations": []}
                     for p in item.get("content", []) if p.get("type") == "output_text"]
            out.append({"type": "message", "id": item["id"], "role": "assistant",
                        "status": item.get("status", "completed"), "content": parts})
        elif item.get("type") == "function_call":
            out.append(dict(item))
    return out


def _one(values: list[str], name: str) -> str | None:
    if len(values) > 1:
        raise ApiError(400, f"{name}: give it once", param=name)
    return values[0] if values else None


def parse_query(query: Mapping[str, list[str]]) -> tuple[str | None, str | None, int, str]:
    """``(after, before, limit, order)`` from the query (``include`` / ``include[]`` checked
    against OpenAI's values, accepted with no effect); a bad value is a 400 naming it."""
    for name in ("include", "include[]"):
        for n, value in enumerate(query.get(name, [])):
            if value not in _INCLUDABLE:
                raise ApiError(400, f"include.{n}: unsupported value {value!r}; one of "
                                    f"{sorted(_INCLUDABLE)}", param=f"include.{n}")
    raw = _one(query.get("limit", []), "limit")
    limit = 20 if raw is None else (int(raw) if raw.strip().lstrip("-").isdigit() else 0)
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit: must be an integer from 1 to 100, not {raw!r}",
                       param="limit")
    order = _one(query.get("order", []), "order") or "desc"
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order: must be 'asc' or 'desc', not {order!r}", param="order")
    return (_one(query.get("after", []), "after"), _one(query.get("before", []), "before"),
            limit, order)


def _at(ids: list[str], cursor: str | None, name: str) -> int | None:
    if cursor is None:
        return None
    if cursor not in ids:
        raise ApiError(400, f"{name}: no input item '{cursor}' in this response", param=name)
    return ids.index(cursor)


def page(items: Sequence[Mapping[str, Any]], *, after: str | None, before: str | None,
         limit: int, order: str) -> dict[str, Any]:
    """One page of ``items`` (stored oldest first) as OpenAI's list object."""
    ordered = [dict(i) for i in (items if order == "asc" else reversed(items))]
    ids = [str(i["id"]) for i in ordered]
    lo, hi = _at(ids, after, "after"), _at(ids, before, "before")
    window = ordered[(0 if lo is None else lo + 1):(len(ordered) if hi is None else hi)]
    if before is not None and after is None:
        # NOTE: ``before`` alone pages backwards: the ``limit`` items nearest the cursor
        data, more = window[-limit:], len(window) > limit
    else:
        data, more = window[:limit], len(window) > limit
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
