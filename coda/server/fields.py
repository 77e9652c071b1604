"""Fields a protocol accepts whose meaning Coda does not provide are refused, never ignored
(issue 14 item 5). Each check names the field in a 400, as the upstream APIs do."""

from __future__ import annotations

from coda.errors import InvalidRequestError
from coda.server.protocol_schemas import ResponsesRequest


def reject_unhonoured(body: ResponsesRequest) -> None:
    """Responses: ``truncation: "auto"`` (Coda never drops input to fit; a prompt past the
    context is a 400) and ``background`` without ``store`` (a background response is only
    reachable by fetching it, as OpenAI requires)."""
    if body.truncation == "auto":
        raise InvalidRequestError(
            "truncation: 'auto' is not supported; Coda never drops input items to fit the "
            "context (use 'disabled')", field="truncation")
    if body.background and not body.store:
        raise InvalidRequestError("background: background responses require store=true",
                                  field="background")
