"""Tools and tool history in the prompt (issue 13 item 1).

Two paths, chosen by the chat template itself:

- a template that knows tools (its source mentions ``tools``): it receives ``tools`` as
  ``transformers`` passes them (a list of ``{"type": "function", "function": {...}}``), assistant
  messages keep ``tool_calls`` (``{"type": "function", "function": {"name", "arguments": dict}}``)
  and tool results are ``{"role": "tool", "content", "tool_call_id"}`` messages;
- any other template (Coda's documented default): the tools are described in a system message
  (merged into the first one if there is one), an assistant's calls are written back in the call
  syntax of :mod:`coda.server.tools`, and a tool result becomes a user message
  ``<tool_response>…</tool_response>``, so every template can render the history.

Anthropic ``tool_use`` / ``tool_result`` blocks are first turned into the OpenAI shape
(:func:`anthropic_history`), so both protocols share the rest.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from coda.errors import InvalidRequestError
from coda.server.tools import CLOSE_TAG, OPEN_TAG, Tool

_DEFAULT_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
_DEFAULT_HOWTO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def template_knows_tools(source: str) -> bool:
    return "tools" in source


def _as_dict(msg: Any) -> dict[str, Any]:
    return dict(msg) if isinstance(msg, Mapping) else msg.model_dump(exclude_none=True)


def _args_obj(raw: Any, field: str) -> dict[str, Any]:
    """A past call's ``arguments`` (``field`` names them) as the object a template renders:
    required, as OpenAI's (a string of JSON; an object where the protocol sends one: Ollama,
    Anthropic); "" is no arguments. JSON that is no object is a 400: a template renders the
    arguments as an object (``tojson``, ``.items()``) and Coda's own calls are always one."""
    if raw is None:
        raise InvalidRequestError(f"{field}: required (the call's arguments, a JSON object "
                                  "as a string)", field=field)
    value = raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise InvalidRequestError(f"{field}: arguments must be JSON", field=field) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{field}: arguments must be a JSON object, got "
                                  f"{type(value).__name__}", field=field)
    return value


def _calls_of(msg: dict[str, Any], field: str) -> list[dict[str, Any]]:
    out = []
    for j, call in enumerate(msg.get("tool_calls") or []):
        f = f"{field}.tool_calls.{j}"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(f"{f}.function.name: required", field=f)
        out.append({"type": "function", "id": call.get("id"),
                    "function": {"name": fn["name"],
                                 "arguments": _args_obj(fn.get("arguments"),
                                                        f"{f}.function.arguments")}})
    return out


def call_text(name: str, arguments: Any) -> str:
    """One call in the default syntax (what a constrained call generates, byte for byte)."""
    return (f"{OPEN_TAG}\n" + json.dumps({"name": name, "arguments": arguments},
                                         ensure_ascii=False) + f"\n{CLOSE_TAG}")


def _tools_prompt(tools: Sequence[Tool]) -> str:
    sigs = "\n".join(json.dumps(t.openai_dict(), ensure_ascii=False) for t in tools)
    return _DEFAULT_PREAMBLE + sigs + _DEFAULT_HOWTO


def prepare(messages: Sequence[Any], tools: Sequence[Tool], source: str,
            field: str = "messages") -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages (plain dicts) and the ``tools`` argument for the template (see module doc)."""
    msgs = [_as_dict(m) for m in messages]
    has_history = any(m.get("tool_calls") or m.get("role") == "tool" for m in msgs)
    if not tools and not has_history:
        return msgs, None
    if template_knows_tools(source):
        out = []
        for i, m in enumerate(msgs):
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = _calls_of(m, f"{field}.{i}")
                m.setdefault("content", "")
                if m["content"] is None:
                    m["content"] = ""
            out.append(m)
        return out, [t.openai_dict() for t in tools] or None
    out = []
    for i, m in enumerate(msgs):
        role = m.get("role")
        if role == "tool":
            text = m.get("content") or ""
            if not isinstance(text, str):
                text = "".join(p.get("text", "") for p in text if isinstance(p, Mapping))
            out.append({"role": "user",
                        "content": f"<tool_response>\n{text}\n</tool_response>"})
        elif role == "assistant" and m.get("tool_calls"):
            calls = _calls_of(m, f"{field}.{i}")
            text = m.get("content") or ""
            if not isinstance(text, str):
                text = "".join(p.get("text", "") for p in text if isinstance(p, Mapping))
            parts = ([text] if text else []) + [call_text(c["function"]["name"],
                                                          c["function"]["arguments"])
                                                for c in calls]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
            out.append(m)
    if tools:
        prompt = _tools_prompt(tools)
        if out and out[0].get("role") in ("system", "developer") and isinstance(
                out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


# NOTE: the text blocks of one Anthropic turn (several in a message, or the messages of one
# role merged into one turn) are separate pieces of text: a blank line between them, never
# glued into one word ("Hello." + "Say hi." was "Hello.Say hi.")
BLOCK_SEPARATOR = "\n\n"


def _block_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return BLOCK_SEPARATOR.join(b.get("text", "") for b in content
                                if isinstance(b, Mapping) and b.get("type") == "text")


def _bad(field: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {what}", field=field)


def _check_block(block: Any, role: str, field: str) -> None:
    """One Anthropic content block's own fields have the types the API requires, so a wrong
    type is a 400 naming it (P1), never a ``TypeError`` in the prompt's rendering (a 500)."""
    if not isinstance(block, Mapping):
        raise _bad(field, "a content block must be an object")
    kind = block.get("type")
    if kind == "text" and not isinstance(block.get("text"), str):
        raise _bad(f"{field}.text", "a text block's text must be a string")
    if kind == "tool_use" and role == "assistant":
        if not isinstance(block.get("name"), str):
            raise _bad(f"{field}.name", "a tool_use block's name must be a string")
        if not isinstance(block.get("input", {}), Mapping):
            raise _bad(f"{field}.input", "a tool_use block's input must be an object")
    if kind == "tool_result" and role == "user":
        # NOTE: as Anthropic types it: "yes" or 1 is a 400, never a silently ignored flag
        if "is_error" in block and not isinstance(block["is_error"], bool):
            raise _bad(f"{field}.is_error", "must be a boolean")
        content = block.get("content")
        if content is None or isinstance(content, str):
            return
        if not isinstance(content, list):
            raise _bad(f"{field}.content", "must be a string or a list of content blocks")
        for k, part in enumerate(content):
            _check_block(part, "", f"{field}.content.{k}")
            # NOTE: a result is rendered from its text blocks: any other is refused, as at
            # the top level, never dropped without a word
            if part.get("type") != "text":
                raise InvalidRequestError(
                    f"{field}.content.{k}: unsupported block type {part.get('type')!r} in a "
                    "tool_result (the served model reads text only)", field=f"{field}.content")


# NOTE: Anthropic's input blocks a text model cannot read (images, PDFs and other documents,
# search results, containers' files): said as such, not as an unknown type
_MEDIA = frozenset({"image", "document", "search_result", "container_upload"})


def _unsupported(kind: Any) -> str:
    if kind in _MEDIA:
        return (f"{kind} content blocks are not supported: no vision or document model is "
                "served (the served model reads text only); send the content as text blocks")
    return f"unsupported block type {kind!r}"


def anthropic_history(role: str, content: Any, field: str) -> list[dict[str, Any]]:
    """One Anthropic message → OpenAI-shaped messages (tool_use → tool_calls, tool_result →
    ``tool`` messages, text blocks kept)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        _check_block(block, role, f"{field}.content.{j}")
        kind = block.get("type")
        if kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"),
                                       "arguments": block.get("input") or {}}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _block_text(block.get("content"))})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            # NOTE: issue 23: an earlier turn's reasoning sent back is not prompt text (the
            # Qwen3 / DeepSeek-R1 templates drop earlier reasoning too)
            continue
        else:
            texts.append(block)
            if kind != "text":
                raise InvalidRequestError(f"{field}.content.{j}: {_unsupported(kind)}",
                                          field=f"{field}.content")
    out: list[dict[str, Any]] = list(results)
    if calls:
        out.append({"role": role, "content": _block_text(texts), "tool_calls": calls})
    elif texts or not results:
        out.append({"role": role, "content": _block_text(texts)})
    return out


def tool_history_item(item: Mapping[str, Any], field: str) -> list[dict[str, Any]]:
    """A Responses ``function_call`` / ``function_call_output`` input item → an OpenAI-shaped
    message (an assistant call, or a tool result)."""
    if item.get("type") == "function_call":
        arguments = item.get("arguments")
        # NOTE: checked here, on the item: the call's later check names the merged message's
        # path (``input.0.tool_calls.0``), which no Responses request has
        _args_obj(arguments, f"{field}.arguments")
        return [{"role": "assistant", "content": "", "tool_calls": [
            {"id": item.get("call_id"), "type": "function",
             "function": {"name": item.get("name"), "arguments": arguments}}]}]
    output = item.get("output")
    if isinstance(output, list):  # NOTE: OpenAI's content parts: the text ones, joined
        texts = []
        for j, part in enumerate(output):
            data = part if isinstance(part, Mapping) else {}
            text = data.get("text")
            if data.get("type") != "input_text" or not isinstance(text, str):
                raise InvalidRequestError(
                    f"{field}.output.{j}: only input_text parts (with their text) are "
                    f"supported, got {data.get('type')!r}", field=f"{field}.output.{j}")
            texts.append(text)
        output = "".join(texts)
    if not isinstance(output, str):
        raise InvalidRequestError(f"{field}.output: must be a string or a list of input_text "
                                  "parts", field=f"{field}.output")
    return [{"role": "tool", "tool_call_id": item.get("call_id"), "content": output}]
