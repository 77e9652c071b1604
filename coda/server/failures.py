"""A FAILED request in each protocol's own idiom (SPEC L4, L5, K3; issue 8 defect 4).

The exact reason stays the loop's (``max_output_tokens`` for a length limit that cut a UTF-8
character, K3) and is always in the ``coda`` object; what tells a client that the request
failed is the protocol's failure shape, chosen by the terminal *state*, never by the reason:

==============  ==========================================  ===========================================
protocol        streaming                                   non-streaming (HTTP 500, ``x-should-retry: false``)
==============  ==========================================  ===========================================
chat, legacy    ``data: {"error": {…}, "coda": {…}}``        ``{"error": {…}, "choices": [partial…], "coda": {…}}``
                then ``data: [DONE]``
Anthropic       one ``event: error`` (with ``coda``)         ``{"type": "error", "error": {…}, "content": [partial], "coda": {…}}``
Responses       ``response.failed``, status ``failed``,      the response object (status ``failed``, ``error``,
                ``error`` set                               partial output, ``coda``)
==============  ==========================================  ===========================================

Why ``x-should-retry: false``: both official SDKs retry a 5xx twice by default; a failure that
is a pure function of the request (a decoding error) retried is billed three times.

A request the engine refuses only after it was accepted (``invalid_request`` or
``context_length_exceeded``: with several models, a request that waited for its model to load
is checked by that model's engine afterwards) is the client's error: HTTP 400 with the
protocol's ``invalid_request_error`` type, never a 5xx.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from coda.errors import ErrorCode
from coda.lifecycle import State
from coda.stream import Terminal

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
