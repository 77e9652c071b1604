"""The Ollama API's model-management endpoints: ``/api/pull``, ``/api/delete``,
``/api/copy``, ``/api/create`` and ``/api/push`` (issue 23 item 2; SPEC P1).

Coda serves the models it was started with (``--model``) and downloads, stores, copies,
builds and uploads nothing, so:

- ``pull`` of a model it serves (any name it goes by, ``:latest`` accepted, as on the other
  Ollama routes) succeeds with nothing to do: ``{"status": "success"}``, or streamed (the
  default, as Ollama) the NDJSON lines ``{"status": "pulling manifest"}`` then
  ``{"status": "success"}`` (no byte progress: no bytes move). A model it does not serve is
  a 404 ``{"error": ...}``, streamed or not: Coda knows before any line is sent, so the
  status says it (Ollama, which learns of a failed download mid-stream, ends its stream
  with an ``{"error": ...}`` line instead; the official client raises ``ResponseError`` on
  either, with the status on this one).
- ``delete``, ``copy``, ``create`` and ``push`` are refused: 403 ``{"error": ...}`` naming
  why (a 4xx clients surface as is and do not retry; 501 would be a 5xx). As Ollama, a
  ``delete``, ``copy`` or ``push`` of a model that does not exist is a 404 instead.
- A body without its model (or ``source`` / ``destination``), or with a field of the wrong
  type, is a 400 in Ollama's shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import JSONResponse, Response, StreamingResponse

from coda.server.common import state_of
from coda.server.http_errors import ApiError
from coda.server.ndjson import JSONLine, NDJSONRenderer
from coda.server.ollama_schemas import model_name
from coda.server.schemas import OPEN

router = APIRouter()

_ORIGIN = ("Coda serves only the models it was started with (--model) and downloads, "
           "stores and uploads no model")


class _Named(BaseModel):
    """A body naming one model: ``model``, or the older ``name``. Other fields (Ollama's
    ``insecure``, ``username``, ...) change nothing here: nothing is fetched or sent."""

    model_config = OPEN
    model: str | None = None
    name: str | None = None
    # NOTE: Ollama streams pull, push and create unless told not to (null: the default)
    stream: bool | None = None
    insecure: bool | None = None

    def required(self) -> str:
        name = self.model or self.name
        if not name:
            raise ApiError(400, "model is required", param="model")
        return model_name(name)


class _Copy(BaseModel):
    model_config = OPEN
    source: str | None = None
    destination: str | None = None


def _served(request: Request, name: str, why: str = "") -> None:
    """A 404 in Ollama's shape (``model '...' not found``, then ``why`` and what is served)
    unless this server serves ``name`` (by any name it goes by)."""
    try:
        state_of(request).check_model(name)
    except ApiError as exc:
        served = exc.message.split("; ", 1)[-1]  # NOTE: "this server serves 'a', 'b'"
        raise ApiError(404, f"model '{name}' not found{why} ({served})", param="model",
                       code="model_not_found") from None


def _refuse(what: str) -> ApiError:
    return ApiError(403, f"{what} is not supported: {_ORIGIN}", code="not_supported")


async def _pull_lines() -> AsyncIterator[bytes]:
    for status in ("pulling manifest", "success"):
        yield JSONLine({"status": status}).encode()


@router.post("/api/pull")
async def pull(body: _Named, request: Request) -> Response:
    """Nothing to download: success for a served model, else a 404."""
    _served(request, body.required(), f": {_ORIGIN}; nothing is downloaded")
    if body.stream is False:
        return JSONResponse({"status": "success"})
    return StreamingResponse(_pull_lines(), media_type=NDJSONRenderer.media_type)


@router.delete("/api/delete")
async def delete(body: _Named, request: Request) -> Response:
    _served(request, body.required())
    raise _refuse("deleting a model")


@router.post("/api/copy")
async def copy(body: _Copy, request: Request) -> Response:
    if not body.source or not body.destination:
        raise ApiError(400, "source and destination are required",
                       param="source" if not body.source else "destination")
    _served(request, model_name(body.source))
    raise _refuse("copying a model")


@router.post("/api/create")
async def create(body: _Named) -> Response:
    body.required()
    raise _refuse("creating a model")


@router.post("/api/push")
async def push(body: _Named, request: Request) -> Response:
    _served(request, body.required())
    raise _refuse("pushing a model")
