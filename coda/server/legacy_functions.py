"""Chat Completions' deprecated function calling (``functions`` / ``function_call``), as the
OpenAI API still serves it: translated onto Coda's tool calling (:mod:`coda.server.tools`) on
the way in, and answered in the legacy shape on the way out (``message.function_call``,
``delta.function_call``, ``finish_reason: "function_call"``) by the chat renderer.

- ``functions: [{name, description, parameters}]`` are function ``tools``; ``function_call``
  ``"none"`` | ``"auto"`` | ``{"name"}`` is the ``tool_choice`` of the same meaning (default
  ``auto`` with functions, as OpenAI). At most one call per answer (the legacy shape has one).
- History: an assistant message's ``function_call`` becomes one ``tool_calls`` entry, and a
  ``{"role": "function", "name", "content"}`` message its result (a ``tool`` message answering
  the last call made), so every template renders legacy history as it renders tools.
- Mixing the two styles (``functions`` with ``tools``, ``function_call`` with
  ``tool_choice``) or ``function_call`` without ``functions`` is a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coda.errors import InvalidRequestError


def legacy_tools(functions: list[dict[str, Any]] | None, function_call: Any,
                 tools: list[dict[str, Any]] | None, tool_choice: Any
                 ) -> tuple[list[dict[str, Any]] | None, Any, bool]:
    """``(tools, tool_choice, legacy)``: the request's tools in the Chat Completions shape, and
    whether the answer uses the legacy ``function_call`` shape."""
    if functions is None:
        if function_call is not None:
            raise InvalidRequestError("function_call: only allowed when functions are given",
                                      field="function_call")
        return tools, tool_choice, False
    if tools is not None:
        raise InvalidRequestError("functions: cannot be combined with tools (use one style)",
                                  field="functions")
    if tool_choice is not None:
        raise InvalidRequestError("function_call: use function_call with functions, not "
                                  "tool_choice", field="tool_choice")
    if not functions:
        raise InvalidRequestError("functions: must not be empty", field="functions")
    as_tools = [{"type": "function", "function": f} for f in functions]
    if function_call is None or isinstance(function_call, str):
        return as_tools, function_call or "auto", True
    name = function_call.get("name")
    if set(function_call) != {"name"} or not isinstance(name, str):
        raise InvalidRequestError("function_call: must be 'none', 'auto' or {\"name\": ...}",
                                  field="function_call")
    return as_tools, {"type": "function", "function": {"name": name}}, True


def _call_id(index: int) -> str:
    return f"call_fn{index}"  # NOTE: local to the request: links a result to its call


def legacy_history(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The messages with legacy ``function_call`` / ``role: "function"`` turns in the tools
    shape (other messages unchanged, as plain dicts)."""
    out: list[dict[str, Any]] = []
    last: str | None = None
    for i, msg in enumerate(messages):
        m = dict(msg) if isinstance(msg, Mapping) else msg.model_dump(exclude_none=True)
        call = m.pop("function_call", None)
        if m.get("role") == "assistant" and call is not None:
            if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
                raise InvalidRequestError(
                    f"messages.{i}.function_call: needs a name and arguments",
                    field=f"messages.{i}.function_call")
            last = _call_id(i)
            m["tool_calls"] = [{"id": last, "type": "function",
                                "function": {"name": call["name"],
                                             "arguments": call.get("arguments") or "{}"}}]
        elif m.get("role") == "function":
            if last is None:
                raise InvalidRequestError(
                    f"messages.{i}: a function message must answer a preceding assistant "
                    "function_call", field=f"messages.{i}.role")
            m = {"role": "tool", "tool_call_id": last, "content": m.get("content") or ""}
        out.append(m)
    return out


def has_legacy_history(messages: Sequence[Any]) -> bool:
    def get(m: Any, key: str) -> Any:
        return m.get(key) if isinstance(m, Mapping) else getattr(m, key, None)

    return any(get(m, "role") == "function" or get(m, "function_call") is not None
               for m in messages)
