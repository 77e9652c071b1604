"""``previous_response_id`` (issue 24 item 3): a Responses request continues a stored
response's conversation — that response's own history and input, then its output (the
assistant message, its function calls), then the new input; the new request's
``instructions`` replace the previous ones (OpenAI's rule: they are not carried over).

The previous response is found through the server's record store: in memory, or with
``--redis-url`` in the stream log (:class:`~coda.server.durable.RedisResponseStore` rebuilds a
record another front end stored), so any front end continues any conversation. A response
still running is waited for (its output is the history); an unknown, unstored or expired one
is OpenAI's 400 ``previous_response_not_found`` naming ``previous_response_id`` (so is a
deleted one: ``DELETE /v1/responses/{id}``).

Beside the messages, the continuation carries the previous response's listed input items and
its output items (:func:`coda.server.responses_items.carried_items`), which its own
``GET /v1/responses/{id}/input_items`` lists before its input."""

from __future__ import annotations

import asyncio
from typing import Any

from coda.reader import terminal_of
from coda.server.http_errors import ApiError
from coda.server.render_spec import ResponsesRender
from coda.server.responses_items import Item, carried_items, listed
from coda.server.state import ServerState
from coda.server.tool_messages import tool_history_item

__all__ = ["previous_history"]


async def previous_history(st: ServerState, response_id: str
                           ) -> tuple[list[dict[str, Any]], list[Item]]:
    """The messages a continuation of ``response_id`` starts with (OpenAI-shaped), and the
    input items it carries over."""
    from coda.server.responses_object import response_object

    record = st.store.get(response_id)  # NOTE: as GET /v1/responses/{id} reads it
    if record is None or not isinstance(record.spec, ResponsesRender) or not record.spec.store:
        # NOTE: OpenAI's 400, words and code: clients recover on the code (resend the history)
        raise ApiError(400, f"Previous response with id '{response_id}' not found.",
                       param="previous_response_id", code="previous_response_not_found")
    await asyncio.gather(*(terminal_of(h.stream) for h in record.handles))
    out: list[dict[str, Any]] = [dict(m) for m in record.spec.history]
    output = response_object(record)["output"]
    for item in output:
        if item["type"] == "message":
            text = "".join(p["text"] for p in item["content"] if p["type"] == "output_text")
            out.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            out += tool_history_item(item, "previous_response_id")
    return out, carried_items(listed(record.id, record.spec), output)
