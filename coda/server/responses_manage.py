"""``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``: the two stored-
response routes of OpenAI's Responses API beside create, retrieve and cancel
(:mod:`coda.server.responses_routes`).

Delete answers ``{"id", "object": "response.deleted", "deleted": true}``; afterwards the id is
unknown everywhere: ``GET``, ``cancel``, ``input_items`` and a second delete are 404s, and
``previous_response_id`` naming it is the 400 of any unknown id. A response still running is
cancelled first (C1) and its terminal awaited, so its engine request releases its KV blocks
and batch slot once, on the cancel path (L7), and every reader attached to its stream (the
creating client, a ``GET ?stream=true`` resume) receives its one terminal event (L2, P2)
before the record is dropped. With ``--redis-url`` the descriptor leaves the log
(:class:`coda.server.durable.RedisResponseStore`): another front end, or this one restarted,
cannot bring it back.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from coda.finish import CancelCause
from coda.reader import terminal_of
from coda.server.common import state_of
from coda.server.http_errors import ApiError
from coda.server.render_spec import ResponsesRender
from coda.server.responses_items import listed, page, parse_query
from coda.server.responses_routes import stored_record

router = APIRouter()


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    """Delete a stored response (cancelled first if still running: C1, L7)."""
    record = stored_record(request, response_id)
    if not record.done:
        record.cancel(CancelCause.CLIENT)  # NOTE: idempotent: the engine releases once (L7)
    # NOTE: every reader gets its one terminal (L2) before the record goes
    await asyncio.gather(*(terminal_of(h.stream) for h in record.handles))
    if not state_of(request).store.delete(response_id):
        # NOTE: a concurrent delete (here or on another front end) won the race
        raise ApiError(404, f"No response found with id '{response_id}'",
                       param="response_id", code="not_found")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request) -> Response:
    """The items the response was generated from, paged as OpenAI's lists."""
    query = {k: request.query_params.getlist(k) for k in request.query_params}
    after, before, limit, order = parse_query(query)
    record = stored_record(request, response_id)
    spec = record.spec
    assert isinstance(spec, ResponsesRender)  # NOTE: stored_record answers responses only
    return JSONResponse(page(listed(record.id, spec), after=after, before=before,
                             limit=limit, order=order))
