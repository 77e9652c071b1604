"""Request rules OpenAI applies before generating, shared by Chat Completions and Responses
(SPEC P1: the same 400, with the same message and ``param``, as OpenAI answers).

``json_object`` output needs the word "json" (any case) somewhere in the messages (Chat:
``messages``; Responses: ``input`` and ``instructions``), as OpenAI requires so that the model
is told to write JSON. (Responses ``max_output_tokens`` is at least 16, as OpenAI's: a bound
of its schema, :mod:`coda.server.protocol_schemas`, refused in OpenAI's words by the
validation handler of :mod:`coda.server.http_errors`.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from coda.server.http_errors import ApiError


def _texts(content: Any) -> Iterable[str]:
    """Every text of a message's content: a string, or parts with a ``text``."""
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
            if isinstance(text, str):
                yield text


def mentions_json(contents: Iterable[Any]) -> bool:
    return any("json" in t.lower() for c in contents for t in _texts(c))


def check_json_word_chat(messages: Iterable[Any]) -> None:
    """Chat ``response_format: json_object`` without "json" in any message: OpenAI's 400."""
    if not mentions_json(m.content for m in messages):
        raise ApiError(400, "'messages' must contain the word 'json' in some form, to use "
                            "'response_format' of type 'json_object'.", param="messages")


def check_json_word_responses(messages: Iterable[dict[str, Any]]) -> None:
    """Responses ``text.format: json_object`` without "json" in the input or instructions."""
    if not mentions_json(m.get("content") for m in messages):
        raise ApiError(400, "Response input messages must contain the word 'json' in some "
                            "form to use 'text.format' of type 'json_object'.", param="input")
