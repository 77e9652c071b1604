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
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from coda.lifecycle import State
from coda.stream import Terminal

FAILED_STATUS = 500
NO_RETRY = {"x-should-retry": "false"}


def is_failed(terminal: Terminal) -> bool:
    """The request ended FAILED (L1); its reason may still be a normal one (K3)."""
    return terminal.state is State.FAILED


def error_code(terminal: Terminal) -> str:
    return terminal.error_code.value if terminal.error_code is not None else "model_error"


def error_message(terminal: Terminal) -> str:
    return terminal.error_message or f"the request failed ({error_code(terminal)})"


def openai_error(terminal: Terminal) -> dict[str, Any]:
    """OpenAI's error object for a failed request (type ``server_error``, exact code)."""
    return {"message": error_message(terminal), "type": "server_error", "param": None,
            "code": error_code(terminal)}


def anthropic_error(terminal: Terminal) -> dict[str, Any]:
    return {"type": "api_error", "message": error_message(terminal)}


def failed_json(body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    """A non-streaming failure: HTTP 500 that the SDKs do not retry."""
    return JSONResponse(body, status_code=FAILED_STATUS, headers={**(headers or {}), **NO_RETRY})
