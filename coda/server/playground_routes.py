"""The playground at ``/`` and the two endpoints it needs (issue 13 item 3; SPEC O1, C1, P5).

- ``GET /`` and ``GET /playground/{asset}``: a static page (HTML, CSS, JS in
  ``coda/server/playground/``; no build step, nothing fetched from outside). Open without the
  API key: it holds no data; the key is typed into the page and sent by the page's own requests.
- ``GET /v1/traces/{request_id}``: the trace rows of a recent request from the engine's
  in-memory :class:`~coda.trace.RecentTraceSink` (``coda serve --recent-traces N``, on by
  default), with times relative to the first row. Requires the API key when one is set.
- ``POST /v1/requests/{request_id}/cancel``: an explicit client cancel (C1, cause ``client``)
  of a chat / completion / message / response request; idempotent.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import FileResponse, JSONResponse, Response

from coda.finish import CancelCause
from coda.server.common import state_of
from coda.server.http_errors import ApiError
from coda.trace import RecentTraceSink

router = APIRouter()
ASSETS = Path(__file__).resolve().parent / "playground"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml"}
OPEN_PATHS = frozenset({"/", "/favicon.ico"})
OPEN_PREFIX = "/playground/"


@router.get("/", include_in_schema=False)
async def index() -> Response:
    return FileResponse(ASSETS / "index.html", media_type=_TYPES[".html"])


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> Response:
    # NOTE: browsers ask for /favicon.ico whatever the page links; an SVG answers them all
    return FileResponse(ASSETS / "favicon.svg", media_type=_TYPES[".svg"])


@router.get("/playground/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    path = (ASSETS / name).resolve()
    # NOTE: only files directly in the asset folder, of known types (no traversal)
    if path.parent != ASSETS or path.suffix not in _TYPES or not path.is_file():
        raise ApiError(404, f"no asset {name!r}", code="not_found")
    return FileResponse(path, media_type=_TYPES[path.suffix])


def _sink(engine: Any) -> RecentTraceSink | None:
    trace = getattr(engine, "trace", None)
    return trace if isinstance(trace, RecentTraceSink) else None


@router.get("/v1/traces/{request_id}")
async def request_trace(request_id: str, request: Request) -> Response:
    """The recent request's trace rows (``t_ms`` from its first row)."""
    sink = _sink(state_of(request).engine)
    if sink is None:
        raise ApiError(404, "the in-memory trace is off (coda serve --recent-traces N)",
                       code="not_found")
    found = await asyncio.to_thread(sink.rows, request_id)  # NOTE: a replica's may block
    if found is None:
        raise ApiError(404, f"no trace kept for '{request_id}'", param="request_id",
                       code="not_found")
    rows, dropped = found
    t0 = rows[0].ts_ns if rows else 0
    return JSONResponse({"request_id": request_id, "dropped_rows": dropped, "rows": [
        {"kind": e.kind, "t_ms": (e.ts_ns - t0) / 1e6, **dict(e.data)} for e in rows]},
        headers={"cache-control": "no-store"})


@router.post("/v1/requests/{request_id}/cancel")
async def cancel_request(request_id: str, request: Request) -> Response:
    """Cancel a running chat / completion / message / response request (C1, cause client):
    a foreground response too, which OpenAI's ``/v1/responses/{id}/cancel`` refuses."""
    record = state_of(request).store.get(request_id)
    if record is None:
        raise ApiError(404, f"No request found with id '{request_id}'", param="request_id",
                       code="not_found")
    record.cancel(CancelCause.CLIENT)
    return JSONResponse({"id": request_id, "object": "request.cancel", "cancelled": True})
