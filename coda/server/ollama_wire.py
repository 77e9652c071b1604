"""The Ollama API's objects from Coda's outcomes (issue 23 item 2; SPEC L4, L5, L6, P5).

``done_reason`` is truthful: ``stop`` for a natural end (eos, a stop string, grammar
complete or closed, a confidence early stop), ``length`` for the output budget or the
context; Coda's other endings (``deadline_exceeded``, ``cancelled``, ``transport_error``,
``content_interrupted``, ...) are written as Coda's own finish reason — Ollama's field is an
open string and none of its values would be true — and the exact outcome is always in the
``coda`` object, as on the other protocols. Counts and durations come from the terminal:
``prompt_eval_count`` is the prompt tokens evaluated (the prompt less its prefix-cache hits,
as Ollama counts), ``eval_count`` the selected output tokens, and the durations are Coda's
timings in nanoseconds (``load_duration`` 0: the model is loaded before a request runs).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from coda.errors import InvalidRequestError
from coda.finish import FinishReason, Terminal
from coda.server import tools as tl
from coda.server.mapping import coda_extension, openai_finish_reason
from coda.server.ollama_schemas import OllamaMessage, duration_s

_LENGTH = frozenset({FinishReason.MAX_OUTPUT_TOKENS, FinishReason.CONTEXT_LIMIT})


def created_at(epoch_s: float) -> str:
    """RFC 3339 in UTC, as Ollama writes ``created_at``."""
    return datetime.fromtimestamp(epoch_s, UTC).isoformat().replace("+00:00", "Z")


def done_reason(reason: FinishReason) -> str:
    if reason in _LENGTH:
        return "length"
    if openai_finish_reason(reason) == "stop":  # NOTE: one list of natural ends (mapping)
        return "stop"
    return reason.value


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


def done_fields(terminal: Terminal, network_send_s: float | None = None) -> dict[str, Any]:
    """The closing fields of the last object (``done: true``), ``coda`` included."""
    u = terminal.usage
    return {"done": True, "done_reason": done_reason(terminal.finish_reason),
            "total_duration": _ns(terminal.total_s), "load_duration": 0,
            "prompt_eval_count": u.prompt_tokens - u.cached_prompt_tokens,
            "prompt_eval_duration": _ns(terminal.prefill_s),
            "eval_count": u.selected_tokens, "eval_duration": _ns(terminal.decode_s),
            "coda": coda_extension(terminal, network_send_s)}


def tool_call(call: tl.ToolCall) -> dict[str, Any]:
    """A call as Ollama writes it: ``arguments`` an object (the grammar made it valid JSON)."""
    return {"function": {"index": call.index, "name": call.name,
                         "arguments": json.loads(call.arguments)}}


def chat_messages(messages: Sequence[OllamaMessage], system: str | None = None
                  ) -> list[dict[str, Any]]:
    """Ollama messages as the chat template's messages. A tool result's ``tool_name`` becomes
    ``name``; ``thinking`` of earlier turns is dropped (templates do not render it)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(messages):
        if m.images:
            raise InvalidRequestError(f"messages.{i}.images: images are not supported (no "
                                      "vision model is served)", field=f"messages.{i}.images")
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            item["tool_calls"] = m.template_calls()
        if m.tool_name:
            item["name"] = m.tool_name
        out.append(item)
    return out


def keep_alive_zero(value: float | str | None) -> bool:
    """``keep_alive`` asks to unload right after the request: 0, or a zero Go duration
    (``"0"``, ``"0s"``, ``"0m"``, ``"0ms"``, ...; the schema refused any other string)."""
    if value is None:
        return False
    if isinstance(value, (int, float)):
        return value == 0
    try:
        return duration_s(value) == 0
    except ValueError:
        return False
