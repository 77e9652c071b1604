"""The stored-response routes of OpenAI's Responses API beside create
(:mod:`coda.server.responses_routes`): ``GET /v1/responses/{id}`` (+ ``stream=true&
starting_after=N`` replay, P3), ``POST /v1/responses/{id}/cancel`` (C1), ``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``; ``POST
/v1/responses/compact`` (OpenAI's compaction) and every ``/v1/conversations`` path (OpenAI's
Conversations API) are refused, saying what to do instead.

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
from coda.reader import logged_until, replay, terminal_of
from coda.server.common import state_of
from coda.server.cursor_page import page
from coda.server.fields import UNOFFERED
from coda.server.http_errors import ApiError
from coda.server.integrity import agree_cursor, resolve_resume
from coda.server.records import Record
from coda.server.render_spec import ResponsesRender
from coda.server.responses_items import listed, parse_query
from coda.server.responses_object import response_object
from coda.server.responses_stream import ResponsesRenderer
from coda.server.sse import SSEResponse, parse_seq

router = APIRouter()


def stored_record(request: Request, rid: str) -> Record:
    """The stored response ``rid``; unknown, unstored or deleted: a 404."""
    record = state_of(request).store.get(rid)
    if record is None or not isinstance(record.spec, ResponsesRender) or not record.spec.store:
        raise ApiError(404, f"No response found with id '{rid}'", param="response_id",
                       code="not_found")
    return record


def _last_event_through(record: Record, seq: int) -> int:
    """The number of the last Responses event rendered for the engine events up to ``seq``.
    NOTE: replayed, not counted: with tools a delta yields zero or several events (issue 20
    D5); without, a delta's is ``seq + 3`` (created, in_progress, then output_item.added and
    content_part.added with the first delta, then one event per delta) and the start's 1; a
    background response's ``queued`` adds one once it started)."""
    r = record.make_renderer([1 << 62])  # NOTE: skips every frame; only numbers them
    assert isinstance(r, ResponsesRenderer)
    r.header()
    for ev in replay(record.streams[0]):
        if ev.seq > seq:
            break
        r.on_event(0, ev, [ev.seq])
    return r.seq - 1


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, stream: bool = False,
                       starting_after: int | None = None, offset: str | None = None,
                       digest: str | None = None) -> Response:
    """The stored response; with ``stream=true`` its event stream replayed after
    ``starting_after`` (or ``Last-Event-ID``), then followed live (P3). ``offset`` (and
    ``digest``) name the output bytes the client holds; a mismatch is a 409."""
    record = stored_record(request, response_id)
    if not stream:
        return JSONResponse(response_object(record))
    st = state_of(request)
    header = request.headers.get("last-event-id", "").strip()
    from_header = parse_seq(header) if header else None
    if header and from_header is None:  # NOTE: P3: never a silent full replay, nor a crash
        raise ApiError(400, "Last-Event-ID must be a sequence_number this stream sent",
                       param="Last-Event-ID")
    after, name = agree_cursor(starting_after, from_header, "starting_after",
                               lambda h, q: h > q)
    if offset is not None or digest is not None:
        resolved = resolve_resume(record.streams, None, offset, digest)
        assert resolved is not None
        held = _last_event_through(record, resolved[0])
        if after is not None and after != held:
            raise ApiError(409, f"offset {offset} is event {held}, not {name} {after}",
                           param="offset", code="resume_mismatch")
        after = held
    after = -1 if after is None else after
    if after < -1:  # NOTE: named as the client sent it (query or header)
        raise ApiError(400, f"{name} must be >= -1", param=name)
    log = record.streams[0]
    await logged_until(record.streams, lambda: log.closed
                       or after <= _last_event_through(record, log.last_seq))
    if log.closed and after > (last := _last_event_through(record, log.last_seq)):
        # NOTE: P3: a number past a finished response's last event was never sent
        raise ApiError(400, f"{name} {after} is past the last sequence_number this stream "
                            f"sent ({last})", param=name)
    # NOTE: a replaying reader never cancels: the original request owns the P4 policy.
    return SSEResponse(record.streams, record.make_renderer([after]),
                       keepalive_s=st.settings.keepalive_s,
                       write_timeout_s=st.settings.write_timeout_s)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    """Cancel a background response (C1); idempotent — a finished one is returned unchanged.
    As OpenAI's, only a response created with ``background: true`` can be cancelled here: a
    foreground one is a 400 (running or not, nothing changes); its client ends it by leaving
    (P4) or through Coda's ``POST /v1/requests/{id}/cancel``."""
    record = stored_record(request, response_id)
    if not record.background:
        raise ApiError(400, f"Cannot cancel a synchronous response: only responses created "
                            f"with background=true can be cancelled, and '{response_id}' was "
                            f"not (its client ends it by disconnecting, or with POST "
                            f"/v1/requests/{response_id}/cancel)")
    record.cancel(CancelCause.CLIENT)
    await asyncio.gather(*(terminal_of(h.stream) for h in record.handles))
    return JSONResponse(response_object(record))


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
                             limit=limit, order=order, what="input item"))


@router.post("/v1/responses/compact")
async def compact_response() -> Response:
    """OpenAI's conversation compaction (the SDK's ``responses.compact``): an opaque
    compacted item only OpenAI's servers read back. Not offered: a 404 saying what to do
    instead (it was a 405 "Method Not Allowed", the path read as a response id)."""
    raise ApiError(404, "POST /v1/responses/compact: conversation compaction is not offered "
                        "by this server; continue with previous_response_id and truncation: "
                        "\"auto\" (the oldest turns are dropped to fit), or send a shorter "
                        "input", code="not_found")


@router.api_route("/v1/conversations{rest:path}", methods=["GET", "POST", "DELETE"])
async def conversations(request: Request) -> Response:
    """OpenAI's Conversations API (the SDK's ``conversations.*``): not offered. A 404 in the
    words of the ``conversation`` field's 400 (it was "Not Found", as a mistyped path)."""
    raise ApiError(404, f"{request.method} {request.url.path}: {UNOFFERED['conversation']}",
                   code="not_found")
