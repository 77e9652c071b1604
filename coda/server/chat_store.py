"""Stored chat completions (OpenAI's ``store: true`` on Chat Completions; SPEC P1): what a
stored completion keeps, and the pages its routes answer (:mod:`coda.server.chat_store_routes`).

A chat completion created with ``store: true`` keeps, on its record's spec
(:class:`~coda.server.render_spec.OpenAIRender`), ``stored``, its ``metadata`` and the request's
``messages`` as sent. The record itself — the engine streams, in the server's one
:class:`~coda.server.state.ResponseStore` beside stored responses — is the completion: a
retrieve renders the same non-streamed object the create answered (a streamed one assembled
from its events), so nothing is copied. With ``--redis-url`` the spec is the record's
descriptor in the stream log, so any front end on that Redis retrieves, updates and deletes it,
and lists it: the log keeps an index of the stored completions
(:meth:`~coda.server.state.ResponseStore.stored_chats`), so every front end lists the same ones
in the same order.

``store`` omitted keeps a completion for ``/v1/streams`` resume only (not retrievable here, as
OpenAI's default ``store: false``); ``store: false`` drops it once it ended (docs/api.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coda.server.cursor_page import one
from coda.server.http_errors import ApiError
from coda.server.records import Record
from coda.server.schemas import ChatCompletionRequest


def stored_fields(body: ChatCompletionRequest) -> dict[str, Any]:
    """The spec fields of a ``store: true`` chat completion: the flag, its metadata and the
    request's messages as plain data (as the client sent them, nulls left out)."""
    return {"stored": True, "metadata": dict(body.metadata or {}),
            "messages": tuple(m.model_dump(mode="json", exclude_none=True)
                              for m in body.messages)}


def is_stored(record: Record | None) -> bool:
    """A chat completion created with ``store: true`` (what the chat routes may serve)."""
    return record is not None and record.stored_chat


def not_found(cid: str) -> ApiError:
    return ApiError(404, f"No chat completion found with id '{cid}'. Only completions "
                         "created with store: true are stored.", param="completion_id",
                    code="not_found")


def store_message(cid: str, index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """A request message as OpenAI's ``ChatCompletionStoreMessage``: an ``id``, the role, the
    content as text (parts joined) with the parts themselves in ``content_parts``."""
    content = message.get("content")
    parts = content if isinstance(content, list) else None
    text = ("".join(str(p.get("text", "")) for p in parts if isinstance(p, Mapping))
            if parts is not None else content)
    out: dict[str, Any] = {"id": f"{cid}-{index}", "role": message.get("role"),
                           "content": text, "content_parts": parts, "refusal": None}
    for key in ("name", "tool_calls", "tool_call_id", "function_call"):
        if key in message:
            out[key] = message[key]
    return out


def metadata_filter(query: Mapping[str, list[str]]) -> dict[str, str]:
    """``metadata[key]=value`` pairs of the list query (the SDK's form of ``metadata=``)."""
    out: dict[str, str] = {}
    for name in query:
        if name.startswith("metadata[") and name.endswith("]"):
            value = one(query, name)
            out[name[len("metadata["):-1]] = value or ""
    return out
