"""Every OpenAI- and Anthropic-shaped answer carries a request id header (SPEC P1: the
official clients' ``_request_id`` / ``APIStatusError.request_id``).

OpenAI's API sends ``x-request-id`` on every answer, errors included; Anthropic's sends
``request-id``. A create (chat, completions, Responses, Messages) already names its own
record there (the id a resume or a trace looks up: ``coda.server.create``); every other answer
under ``/v1/`` (a Responses retrieve, cancel, delete or ``input_items``, a model card, and
every 4xx: validation, auth, a body over the limit, an unknown id) gets a fresh ``req_…`` id
from :class:`RequestIdMiddleware`. Ollama's API sends none, so ``/api/`` is left as it is.
"""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coda.server.http_errors import protocol_of

# NOTE: lower-case, as ASGI carries header names
OPENAI_HEADER = b"x-request-id"
ANTHROPIC_HEADER = b"request-id"


def fresh_request_id() -> str:
    """A request id for an answer that names no record (``req_`` + 32 hex, as OpenAI's)."""
    return f"req_{uuid.uuid4().hex}"


def header_for(path: str) -> bytes | None:
    """The request id header of the protocol served at ``path``; None where none is sent."""
    if not path.startswith("/v1/"):
        return None
    protocol = protocol_of(path)
    if protocol == "anthropic":
        return ANTHROPIC_HEADER
    return OPENAI_HEADER if protocol == "openai" else None


class RequestIdMiddleware:
    """Adds the protocol's request id header to an answer that lacks one (see module doc).
    Outermost, so a 401 of the key check and a 413 of the body limit carry it too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = header_for(scope["path"]) if scope["type"] == "http" else None
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
