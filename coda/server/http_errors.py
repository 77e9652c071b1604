"""Every error in the protocol's own shape (issue 4 item 5).

OpenAI: ``{"error": {"message", "type", "param", "code"}}``; Anthropic:
``{"type": "error", "error": {"type", "message"}, "request_id"}`` (the id of its ``request-id``
header, in the body too as Anthropic sends it: the SDK's ``ErrorResponse.request_id``); Ollama: ``{"error": "message"}``. The
protocol is chosen by path (``/v1/messages`` is Anthropic, ``/api/`` is Ollama; an Anthropic
client's ``/v1/models`` and unrouted requests are Anthropic's: :func:`scope_protocol`). Bad input is always 4xx and names the field; only a fault of
the server itself is a 5xx. Every answer but Ollama's carries the protocol's request id
header, errors included (:class:`RequestIdMiddleware`).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coda.errors import CodaError, ContextLengthExceededError, ErrorCode, ModelNotFoundError
from coda.finish import Terminal
from coda.lifecycle import State
from coda.server.validation_words import describe_validation, out_of_range

log = logging.getLogger("coda.server")

Protocol = Literal["openai", "anthropic", "ollama"]

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 529: "overloaded_error"}
# NOTE: Anthropic's overload is 529 overloaded_error ("temporarily overloaded", for every
# client); its 429 rate_limit_error is one account's own rate limit, which Coda has none of.
# A full waiting queue (admission's 429) and a server shutting down or a model that cannot
# start (503) are the server's state, not the caller's: both are Anthropic's 529
_ANTHROPIC_OVERLOAD = frozenset({429, 503})
ANTHROPIC_OVERLOADED = 529


class ApiError(Exception):
    """Raised by route code; rendered by the app's handler in the caller's protocol."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers, self.details = headers, details


def protocol_of(path: str) -> Protocol:
    if path.startswith("/api/"):
        return "ollama"
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def scope_protocol(scope: Scope) -> Protocol:
    """The protocol a request is answered in: its path's (:func:`protocol_of`), except that a
    request from an Anthropic client (the ``anthropic-version`` header every Anthropic SDK
    sends) is answered in Anthropic's shape, its errors and its ``request-id`` header
    included, on ``/v1/models`` (``client.models.list()`` / ``.retrieve()``) and on a path or
    method no route takes (its 404 / 405: the client is Anthropic's, whatever it asked for)."""
    path = scope["path"]
    if (not path.startswith(("/api/", "/v1/messages"))
            and any(k.lower() == b"anthropic-version" for k, _ in scope.get("headers", ()))
            and (path.startswith("/v1/models") or not _routed(scope))):
        return "anthropic"
    return protocol_of(path)


def _routed(scope: Scope) -> bool:
    """A route of the app takes this path and method (Starlette's full match; the app is in
    the scope before any middleware runs)."""
    router = getattr(scope.get("app"), "router", None)
    return any(r.matches(scope)[0] is Match.FULL for r in getattr(router, "routes", ()))


def error_payload(protocol: Protocol, status: int, message: str, *, param: str | None = None,
                  code: str | None = None, details: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """The protocol's error body; ``details``: Anthropic's ``error.details`` (what its SDK
    reads to recover, as ``thread_unsupported_request``), left out elsewhere."""
    if protocol == "ollama":
        return {"error": message}  # NOTE: Ollama's one error shape, whatever the status
    if protocol == "anthropic":
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else
                                    "invalid_request_error")
        error: dict[str, Any] = {"type": kind, "message": message}
        if details is not None:
            error["details"] = details
        return {"type": "error", "error": error}
    # NOTE: a 429 (overloaded, docs/api.md "Overload") is no fault of the request: OpenAI's
    # own overloaded 429 ("The server is currently overloaded with other requests") carries
    # server_error, as its 5xx do
    kind = "invalid_request_error" if status < 500 and status != 429 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(protocol: Protocol, status: int, message: str, *, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None,
                   details: dict[str, Any] | None = None) -> JSONResponse:
    if protocol == "ollama" and status == 429:
        # NOTE: Ollama's own full queue (OLLAMA_MAX_QUEUE) answers 503 "server busy, please
        # try again": what a client written against Ollama handles (it never sends a 429)
        status = 503
    if protocol == "anthropic" and status in _ANTHROPIC_OVERLOAD:
        status = ANTHROPIC_OVERLOADED  # NOTE: anthropic.OverloadedError, retried by the SDK
    payload = error_payload(protocol, status, message, param=param, code=code, details=details)
    if protocol == "anthropic":  # NOTE: one id, in the body and the header (module doc)
        rid = (headers or {}).get("request-id") or fresh_request_id()
        payload["request_id"] = rid
        headers = {**(headers or {}), "request-id": rid}
    return JSONResponse(payload, status_code=status, headers=headers)


def wire_words(message: str, rename: Mapping[str, str]) -> str:
    """The engine's message in the wire's words: every engine field it names, as a whole
    identifier, is the protocol's own (``min_tokens (5) must not exceed max_output_tokens
    (3)`` on Responses, the error's own field or another). "prompt" in the engine's words is
    the prompt itself ("the prompt has 9000 tokens"), what every protocol builds from its
    messages / input: renamed, it read "the messages has 9000 tokens"; it stays (the field is
    named before it instead)."""
    names = {k: v for k, v in rename.items() if k != "prompt" and v != k}
    if not names:
        return message
    # NOTE: one pass (a wire name is never renamed again); ``stop`` is not ``stop_token_ids``'s
    # nor ``early_stop.stop``'s
    pattern = "|".join(re.escape(k) for k in sorted(names, key=len, reverse=True))
    return re.sub(rf"(?<![\w.])(?:{pattern})(?!\w)", lambda m: names[m[0]], message)


def api_error_from(exc: CodaError, rename: Mapping[str, str] | None = None,
                   prompt: int | None = None) -> ApiError:
    """A typed engine/validation error as an :class:`ApiError`; ``rename`` maps engine field
    names (``deadline_s``, ``prompt``) to the protocol's own (``deadline``, ``messages``).
    ``prompt``: the error is one prompt's of a batch (legacy completions' list of prompts),
    named by its index in the message (``prompt[2]: ...``, as OpenAI and vLLM name it); the
    ``param`` stays the field (``prompt``, ``max_tokens``)."""
    param = exc.field
    if param is not None and rename:
        param = rename.get(param, param)
    message = wire_words(exc.message, rename or {})
    if param and param not in message:
        message = f"{param}: {message}"
    if prompt is not None:
        name = (rename or {}).get("prompt", "prompt")
        message = f"{name}[{prompt}]: {message.removeprefix(f'{name}: ')}"
    if isinstance(exc, ModelNotFoundError):
        return ApiError(404, message, param="model", code="model_not_found")
    if isinstance(exc, ContextLengthExceededError):
        return ApiError(400, message, param=param, code="context_length_exceeded")
    if exc.code in (ErrorCode.ENGINE_SHUTDOWN, ErrorCode.ENGINE_NOT_STARTED):
        return ApiError(503, message, code=exc.code.value)
    return ApiError(400, message, param=param, code=exc.code.value)


def install_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise to the protocol's error shape."""

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(scope_protocol(request.scope), exc.status, exc.message,
                              param=exc.param, code=exc.code, headers=exc.headers,
                              details=exc.details)

    @app.exception_handler(CodaError)
    async def _coda(request: Request, exc: CodaError) -> JSONResponse:
        err = api_error_from(exc)
        return error_response(scope_protocol(request.scope), err.status, err.message,
                              param=err.param, code=err.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        protocol = scope_protocol(request.scope)
        message, param = describe_validation(exc, request.headers.get("content-type"),
                                             protocol)
        code = "invalid_request"
        out = out_of_range(exc, request)
        if out is not None and protocol == "openai":
            message, code = out
        return error_response(protocol, 400, message, param=param, code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            # NOTE: Starlette's words for a path no route takes (an SDK's batches, files,
            # ...): named, so a missing endpoint is not read as a wrong base URL
            message = (f"{request.method} {request.url.path}: no such endpoint on this "
                       "server (docs/api.md lists the endpoints Coda serves)")
        return error_response(scope_protocol(request.scope), exc.status_code, message,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(json.JSONDecodeError)
    async def _json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(scope_protocol(request.scope), 400, f"malformed JSON body: {exc}")

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        # NOTE: Starlette answers this one outside every middleware (ServerErrorMiddleware):
        # the request id header is added here
        name = _id_header(request.scope)
        return error_response(scope_protocol(request.scope), 500,
                              f"internal error: {type(exc).__name__}", code="internal_error",
                              headers={name.decode(): fresh_request_id()} if name else None)


def fresh_request_id() -> str:
    """An id for an answer that names no record: ``req_`` + 32 hex, as OpenAI's."""
    return f"req_{uuid.uuid4().hex}"


def _id_header(scope: Scope) -> bytes | None:
    """The request id header of the protocol the request is answered in (lower-case, as ASGI
    carries header names): OpenAI's ``x-request-id`` (Coda's own routes too), Anthropic's
    ``request-id`` (``/v1/messages…``, and ``/v1/models…`` asked by an Anthropic client: the
    SDK's ``_request_id``); None on Ollama's routes (its API sends none)."""
    protocol = scope_protocol(scope)
    return b"request-id" if protocol == "anthropic" else (
        b"x-request-id" if protocol == "openai" else None)


class RequestIdMiddleware:
    """Every OpenAI- and Anthropic-shaped answer carries its protocol's request id header
    (SPEC P1: the SDKs' ``_request_id`` and ``APIStatusError.request_id``), as the real APIs
    send one on every answer, errors included. A create names its own record there
    (``coda.server.common``: the id a resume or a trace looks up); any other answer off
    ``/api/`` (a Responses retrieve, cancel, delete or ``input_items``, a model card, every 4xx
    of a route, the key check or the body limit) gets a fresh ``req_`` + 32 hex id. Outermost,
    so the 401 and 413 of the middlewares below carry it too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = _id_header(scope) if scope["type"] == "http" else None
        if name is None:
            await self.app(scope, receive, send)
            return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                # NOTE: a create's own id (its record's) wins: only a missing one is added
                if not any(k.lower() == name for k, _ in headers):
                    headers.append((name, fresh_request_id().encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, stamped)


# -- A FAILED request in each protocol's own idiom (SPEC L4, L5, K3; issue 8 defect 4) --------
# The exact reason stays the loop's (``max_output_tokens`` for a length limit that cut a UTF-8
# character, K3) and is always in the ``coda`` object; what tells a client the request failed
# is the protocol's failure shape, chosen by the terminal *state*, never by the reason. Chat
# and legacy stream ``data: {"error": {…}, "coda": {…}}`` then ``[DONE]``; Anthropic one
# ``event: error``; Responses ``response.failed`` (status ``failed``, ``error`` set). Not
# streamed: HTTP 500 with ``x-should-retry: false`` (both official SDKs retry a 5xx twice; a
# failure that is a pure function of the request, retried, is billed three times) and the
# protocol's body with the partial output and ``coda``. A request the engine refuses only
# after it was accepted (``invalid_request``, ``context_length_exceeded``: with several models,
# one checked by its model's engine after the load) is the client's error: HTTP 400 with the
# protocol's ``invalid_request_error`` type, never a 5xx. (Merged from ``failures.py``: one
# home for every error shape, issue 22's walk.)
FAILED_STATUS = 500
NO_RETRY = {"x-should-retry": "false"}
# NOTE: codes that name a defect of the request itself, whenever it is found
REQUEST_ERRORS = frozenset({ErrorCode.INVALID_REQUEST, ErrorCode.CONTEXT_LENGTH_EXCEEDED})


def is_request_error(terminal: Terminal) -> bool:
    return terminal.error_code in REQUEST_ERRORS


def is_failed(terminal: Terminal) -> bool:
    """The request ended FAILED (L1); its reason may still be a normal one (K3)."""
    return terminal.state is State.FAILED


def error_code(terminal: Terminal) -> str:
    return terminal.error_code.value if terminal.error_code is not None else "model_error"


def error_message(terminal: Terminal) -> str:
    return terminal.error_message or f"the request failed ({error_code(terminal)})"


def openai_error(terminal: Terminal) -> dict[str, Any]:
    """OpenAI's error object for a failed request (type ``server_error``, exact code)."""
    kind = "invalid_request_error" if is_request_error(terminal) else "server_error"
    return {"message": error_message(terminal), "type": kind, "param": None,
            "code": error_code(terminal)}


def anthropic_error(terminal: Terminal) -> dict[str, Any]:
    kind = "invalid_request_error" if is_request_error(terminal) else "api_error"
    return {"type": kind, "message": error_message(terminal)}


def failed_json(body: dict[str, Any], terminal: Terminal,
                headers: dict[str, str] | None = None) -> JSONResponse:
    """A non-streaming failure: HTTP 500 that the SDKs do not retry, or 400 where the request
    itself was at fault."""
    status = 400 if is_request_error(terminal) else FAILED_STATUS
    return JSONResponse(body, status_code=status, headers={**(headers or {}), **NO_RETRY})
