"""A stored response's input items, as ``GET /v1/responses/{id}/input_items`` lists them
(OpenAI's ``ResponseItemList``), from its :class:`~coda.server.render_spec.ResponsesRender`
(so the Redis log carries them to every front end).

What is listed is what the response was generated from, as OpenAI lists it: with
``previous_response_id`` the items the chain carried over (the previous response's own listed
items, then its output message and function calls, keeping their ids; stored when the
continuation was created), then the request's own input; ``instructions`` are not an item. A
string input is one ``user`` message with one ``input_text`` part. An own item's id is the
client's (when it gave one not already in the list), else derived from the response's id and
the item's place (``msg_<response>_in<n>``): the same on every call and every front end, with
nothing stored, and a plain request builds no listing (issue 22: its walk is unchanged).

Pagination is OpenAI's cursor list (:mod:`coda.server.cursor_page`), newest first by default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, get_args

from coda.server.cursor_page import page_query
from coda.server.http_errors import ApiError
from coda.server.protocol_schemas import ResponseIncludable
from coda.server.render_spec import ResponsesRender

__all__ = ["carried_items", "listed", "own_items", "parse_query"]

Item = dict[str, Any]
_INCLUDABLE = frozenset(get_args(ResponseIncludable))
_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_",
           "reasoning": "rs_"}


def _text_part(role: str, text: str) -> dict[str, Any]:
    if role == "assistant":  # NOTE: an assistant message lists as output text, as OpenAI's
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def _own_id(given: object, derived: str, taken: set[str]) -> str:
    """The client's id if it gave an unused one, else ``derived`` (made unused): ids are
    unique in a list, so ``after`` / ``before`` name one item."""
    rid = given if isinstance(given, str) and given and given not in taken else derived
    while rid in taken:
        rid += "_"
    taken.add(rid)
    return rid


def own_items(response_id: str, given: str | Sequence[Mapping[str, Any]],
              carried: Sequence[Mapping[str, Any]]) -> list[Item]:
    """The request's ``input`` (as sent: a string, or its items dumped) as listed items."""
    taken = {str(i.get("id")) for i in carried}
    tag = response_id.removeprefix("resp_")
    if isinstance(given, str):
        return [{"type": "message", "id": _own_id(None, f"msg_{tag}_in0", taken),
                 "role": "user", "status": "completed", "content": [_text_part("user", given)]}]
    out: list[Item] = []
    for n, item in enumerate(given):
        kind = str(item.get("type") or "message")
        rid = _own_id(item.get("id"), f"{_PREFIX.get(kind, 'item_')}{tag}_in{n}", taken)
        if kind == "function_call":
            out.append({"type": kind, "id": rid, "call_id": item.get("call_id"),
                        "name": item.get("name"), "arguments": item.get("arguments") or "",
                        "status": "completed"})
        elif kind == "function_call_output":
            out.append({"type": kind, "id": rid, "call_id": item.get("call_id"),
                        "output": item.get("output"), "status": "completed"})
        elif kind == "reasoning":  # NOTE: listed as sent (not in the prompt: responses_routes)
            out.append({**item, "id": rid})
        else:
            role, content = str(item.get("role")), item.get("content")
            parts = ([_text_part(role, content)] if isinstance(content, str)
                     else [dict(p) for p in content or []])
            out.append({"type": "message", "id": rid, "role": role, "status": "completed",
                        "content": parts})
    return out


def listed(response_id: str, spec: ResponsesRender) -> list[Item]:
    """Every item a stored response lists, oldest first."""
    carried = [dict(i) for i in spec.carried_items]
    return [*carried, *own_items(response_id, spec.own_input, carried)]


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


def parse_query(query: Mapping[str, list[str]]) -> tuple[str | None, str | None, int, str]:
    """``(after, before, limit, order)`` from the query (``include`` / ``include[]`` checked
    against OpenAI's values, accepted with no effect); a bad value is a 400 naming it."""
    for name in ("include", "include[]"):
        for n, value in enumerate(query.get(name, [])):
            if value not in _INCLUDABLE:
                raise ApiError(400, f"include.{n}: unsupported value {value!r}; one of "
                                    f"{sorted(_INCLUDABLE)}", param=f"include.{n}")
    return page_query(query, "desc")
