"""The stored chat completion routes (OpenAI's ``client.chat.completions.retrieve / list /
update / delete`` and ``.messages.list``; SPEC P1): ``GET /v1/chat/completions/{id}``,
``GET /v1/chat/completions``, ``POST /v1/chat/completions/{id}`` (metadata),
``DELETE /v1/chat/completions/{id}`` and ``GET /v1/chat/completions/{id}/messages``.

Only a completion created with ``store: true`` is served (:mod:`coda.server.chat_store`);
any other id is a 404 in OpenAI's error shape. A stored completion still running is waited
for (a delete cancels it first, as a stored response's, C1, L7).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from coda.errors import InvalidRequestError
from coda.finish import CancelCause
from coda.reader import terminal_of
from coda.server.chat_store import is_stored, metadata_filter, not_found, store_message
from coda.server.common import state_of
from coda.server.cursor_page import page, page_query
from coda.server.fields import check_metadata
from coda.server.openai_final import final_object
from coda.server.records import Record
from coda.server.render_spec import OpenAIRender

router = APIRouter()


def _stored(request: Request, cid: str) -> Record:
    record = state_of(request).store.get(cid)
    if record is None or not is_stored(record):
        raise not_found(cid)
    return record


async def _object(record: Record) -> dict[str, Any]:
    """The completion as the create answered it (non-streamed shape), with its metadata."""
    spec = record.spec
    assert isinstance(spec, OpenAIRender)
    terminals = list(await asyncio.gather(*(terminal_of(h.stream) for h in record.handles)))
    return {**final_object(record, terminals, spec), "metadata": dict(spec.metadata)}


def _query(request: Request) -> dict[str, list[str]]:
    return {k: request.query_params.getlist(k) for k in request.query_params}


@router.get("/v1/chat/completions")
async def list_chat_completions(request: Request) -> Response:
    """The stored chat completions (ended ones, oldest first unless ``order=desc``), filtered
    by ``model`` and ``metadata[key]=value``, paged by ``after`` / ``limit``."""
    query = _query(request)
    after, _, limit, order = page_query(query, "asc")  # NOTE: OpenAI's list pages by after
    models = query.get("model", [])
    model = models[-1] if models else None
    wanted = metadata_filter(query)
    # NOTE: ended ones, oldest first, every front end's with the durable log (ResponseStore)
    records = [r for r in state_of(request).store.stored_chats()
               if model is None or r.model == model]
    items = []
    for r in records:
        assert isinstance(r.spec, OpenAIRender)
        if all(r.spec.metadata.get(k) == v for k, v in wanted.items()):
            items.append(await _object(r))
    return JSONResponse(page(items, after=after, before=None, limit=limit, order=order,
                             what="stored chat completion"))


@router.get("/v1/chat/completions/{completion_id}")
async def retrieve_chat_completion(completion_id: str, request: Request) -> Response:
    """A stored chat completion (404 unless created with ``store: true``)."""
    return JSONResponse(await _object(_stored(request, completion_id)))


@router.post("/v1/chat/completions/{completion_id}")
async def update_chat_completion(completion_id: str, request: Request) -> Response:
    """Replace a stored completion's ``metadata`` (the one field OpenAI lets change)."""
    record = _stored(request, completion_id)
    try:
        body = await request.json()
    except ValueError:
        raise InvalidRequestError("the body must be a JSON object", field="metadata") from None
    if not isinstance(body, dict) or "metadata" not in body:
        raise InvalidRequestError("Missing required parameter: 'metadata'.", field="metadata")
    unknown = sorted(set(body) - {"metadata"})
    if unknown:
        raise InvalidRequestError(f"Unrecognized request argument supplied: {unknown[0]}",
                                  field=unknown[0])
    metadata = body["metadata"] or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise InvalidRequestError("metadata: must be an object of string values",
                                  field="metadata")
    check_metadata(metadata)
    assert isinstance(record.spec, OpenAIRender)
    record.spec = replace(record.spec, metadata=dict(metadata))
    state_of(request).store.put(record)  # NOTE: with --redis-url: the descriptor rewritten
    return JSONResponse(await _object(record))


@router.delete("/v1/chat/completions/{completion_id}")
async def delete_chat_completion(completion_id: str, request: Request) -> Response:
    """Delete a stored completion (cancelled first if still running: C1, L7)."""
    record = _stored(request, completion_id)
    if not record.done:
        record.cancel(CancelCause.CLIENT)
    await asyncio.gather(*(terminal_of(h.stream) for h in record.handles))
    if not state_of(request).store.delete(completion_id):
        raise not_found(completion_id)  # NOTE: a concurrent delete won the race
    return JSONResponse({"id": completion_id, "object": "chat.completion.deleted",
                         "deleted": True})


@router.get("/v1/chat/completions/{completion_id}/messages")
async def list_chat_messages(completion_id: str, request: Request) -> Response:
    """The request messages of a stored completion, paged (oldest first by default)."""
    after, _, limit, order = page_query(_query(request), "asc")
    record = _stored(request, completion_id)
    assert isinstance(record.spec, OpenAIRender)
    items = [store_message(completion_id, i, m) for i, m in enumerate(record.spec.messages)]
    return JSONResponse(page(items, after=after, before=None, limit=limit, order=order,
                             what="message"))
