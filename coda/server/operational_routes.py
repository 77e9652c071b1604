"""The operational endpoints (``/health``, ``/metrics``, ``/v1/models``) and the stream
resume (``GET /v1/streams/{id}``, SPEC P3) of the Coda server (:mod:`coda.server.app`)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from coda.engine.protocol import Engine
from coda.reader import logged_until, merge_order, replay
from coda.server import anthropic_models
from coda.server.common import state_of
from coda.server.http_errors import ApiError
from coda.server.integrity import agree_cursor, resolve_resume
from coda.server.records import Record
from coda.server.sse import SSEResponse, id_ahead, parse_position_id


def model_card(engine: Engine) -> dict[str, Any]:
    routed = getattr(engine, "model_card", None)
    if routed is not None:  # NOTE: several models: the selected one's card
        return dict(routed())
    card = {"id": engine.model_name, "object": "model",
            "created": engine.model_info().modified, "owned_by": "coda",
            "max_model_len": engine.context_length}
    card["coda"] = engine.identity.to_dict()  # P1: what produces the output, by content
    return card


def _cursor(raw: str | None, n: int) -> tuple[list[int], int] | None:
    """A resume id as given (``after=`` or ``Last-Event-ID``, P3): None when absent or blank;
    one that is not an id of this stream is a 400 (``after=`` reads as ``Last-Event-ID``)."""
    parsed = parse_position_id(raw, n)
    if raw is not None and raw.strip() and parsed is None:
        raise ApiError(400, f"Last-Event-ID must be {n} comma-separated sequence numbers (an "
                            "id this stream sent)", param="Last-Event-ID")
    return parsed


def _group_size(record: Record, positions: list[int]) -> int | None:
    """How many frames the group after ``positions`` of a finished record renders (the next
    event's, else the footer's), as the resuming pump renders it; None while a stream runs."""
    streams = record.streams
    if not all(s.closed for s in streams):
        return None
    r = record.make_renderer(list(positions))
    r.header()
    events = merge_order((i, ev) for i, s in enumerate(streams) for ev in replay(s, positions[i]))
    if not events:
        return len(r.footer())
    index, ev = events[0]
    return len(r.on_event(index, ev, [ev.seq if i == index else p
                                      for i, p in enumerate(positions)]))


def register(app: FastAPI) -> None:
    """Add the operational routes and the stream resume to ``app``."""
    @app.get("/health")
    async def health(request: Request) -> Response:
        st = state_of(request)
        if st.shutting_down:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        stats = await asyncio.to_thread(st.engine.stats)  # NOTE: a remote engine's may block
        return JSONResponse({"status": "ok", "model": st.engine.model_name,
                             "num_running": stats.num_running,
                             "num_waiting": stats.num_waiting})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body = await asyncio.to_thread(state_of(request).metrics.render)  # NOTE: see /health
        return Response(body,
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        engine = state_of(request).engine
        cards = getattr(engine, "model_cards", None)  # NOTE: several models: every one
        data = cards() if cards is not None else [model_card(engine)]
        if anthropic_models.wants_anthropic(request):  # NOTE: an Anthropic client: its shape
            return anthropic_models.model_list(data, request.query_params)
        return JSONResponse({"object": "list", "data": data})

    # NOTE: P1: an id may hold slashes ("org/name", a --model path), sent as %2F, decoded
    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> Response:
        st = state_of(request)
        if anthropic_models.wants_anthropic(request):  # NOTE: an Anthropic client: its shape
            try:
                st.check_model(model_id)
            except ApiError as exc:  # NOTE: its 404, in Anthropic's error shape
                return anthropic_models.not_found(exc.status, exc.message)
            return JSONResponse(anthropic_models.model_info(model_card(st.engine)))
        st.check_model(model_id)
        return JSONResponse(model_card(st.engine))

    @app.get("/v1/streams/{request_id}")
    async def resume_stream(request_id: str, request: Request, after: str | None = None,
                            offset: str | None = None, digest: str | None = None
                            ) -> Response:
        """Coda extension (P3): replay a chat / completion / message stream after the SSE id
        given as ``Last-Event-ID`` (or ``after``), then follow it live. ``offset`` (and
        ``digest``) name the output bytes the client holds; a mismatch is a 409
        (:mod:`coda.server.integrity`)."""
        st = state_of(request)
        record = st.store.get(request_id)
        if record is None or record.kind == "response":
            raise ApiError(404, f"No stream found with id '{request_id}'", param="request_id",
                           code="not_found")
        header = request.headers.get("last-event-id")
        parsed, name = agree_cursor(_cursor(after, len(record.handles)),
                                    _cursor(header, len(record.handles)), "after", id_ahead)
        raw = after if name == "after" else header
        positions, held = parsed if parsed is not None else (None, 0)
        if positions is not None:
            ahead = positions  # NOTE: judged below once logged or ended (--redis-url: lag)
            await logged_until(record.streams, lambda: all(
                s.closed or p <= s.last_seq for s, p in zip(record.streams, ahead, strict=True)))
        for i, stream in enumerate(record.streams):
            # NOTE: P3: an id past a finished stream's terminal was never sent: a 400, not an
            # empty, footer-only or spliced replay
            if positions is not None and stream.closed and positions[i] > stream.last_seq:
                raise ApiError(400, f"Last-Event-ID names sequence number {positions[i]} of "
                                    f"choice {i}, past the last this stream sent "
                                    f"({stream.last_seq})", param="Last-Event-ID")
        size = _group_size(record, positions) if positions is not None and held else None
        if size is not None and held >= size:
            # NOTE: P3: a group's last frame carries the plain id, so ``P.k`` names k < its
            # frames; more would silently drop the next event's frames
            raise ApiError(400, f"Last-Event-ID {raw!r} names frame {held} of a group of "
                                f"{size}: not an id this stream sent", param="Last-Event-ID")
        positions = resolve_resume(record.streams, positions, offset, digest)
        renderer = record.make_renderer(positions)
        renderer.held = held if positions is not None else 0
        return SSEResponse(record.streams, renderer,
                           keepalive_s=st.settings.keepalive_s,
                           write_timeout_s=st.settings.write_timeout_s)
