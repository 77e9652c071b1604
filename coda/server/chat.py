"""Chat template rendering with jinja2 (issue 4 item 2, issue 9).

The template is the model's own (``engine.chat``: ``chat_template.jinja``, ``chat_template.json``,
``tokenizer_config.json`` or GGUF metadata, resolved in ``coda/models/tokenizer_bundle.py``;
ChatML when the model has none, which the CLI says at load). It runs in jinja2's sandbox with
the helpers HF templates expect (``raise_exception``, ``strftime_now``,
``bos_token``/``eos_token``). Roles are validated before rendering; an error the template
raises (e.g. "roles must alternate") is a 400 on the ``messages`` field, never a 5xx.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from coda.errors import InvalidRequestError
from coda.models.tokenizer_bundle import TokenizerBundle
from coda.server.tool_messages import prepare
from coda.server.tools import Tool

if TYPE_CHECKING:
    import jinja2

    from coda.engine.protocol import Engine

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class TemplateRaised(Exception):
    """``raise_exception`` called by the template itself."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    # NOTE: jinja2 is imported by the first render, not by the server's start (issue 19 item 2)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def _tojson(value: Any, indent: int | None = None) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, indent=indent)


def content_text(content: Any, field: str, *, refusal: bool = False) -> str:
    """A message's content as plain text: a string, or text parts joined (others → 400);
    with ``refusal`` (an assistant's message) a ``refusal`` part is its text too: what the
    assistant said, as OpenAI's assistant message takes it."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for i, part in enumerate(content):
        data = part if isinstance(part, Mapping) else getattr(part, "__dict__", {})
        kind = data.get("type")
        text = data.get("text")
        if kind in ("text", "input_text", "output_text") and isinstance(text, str):
            parts.append(text)
        elif refusal and kind == "refusal" and isinstance(data.get("refusal"), str):
            parts.append(data["refusal"])
        else:
            raise InvalidRequestError(
                f"{field}.content.{i}: only text content parts are supported (got {kind!r})",
                field=f"{field}.content.{i}")  # NOTE: the part, as the message names it
    return "".join(parts)


def normalise_messages(messages: Sequence[Any], field: str = "messages",
                       roles: frozenset[str] = CHAT_ROLES) -> list[dict[str, Any]]:
    """Validate roles and flatten content; ``developer`` renders as ``system``; an assistant's
    ``tool_calls`` and a tool result's ``tool_call_id`` are kept for templates that use them."""
    if not messages:
        raise InvalidRequestError(f"{field} must not be empty", field=field)
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        data = msg if isinstance(msg, Mapping) else msg.model_dump()
        role = data.get("role")
        if role not in roles:
            raise InvalidRequestError(
                f"{field}.{i}.role must be one of {sorted(roles)}, got {role!r}",
                field=f"{field}.{i}.role")
        text = content_text(data.get("content"), f"{field}.{i}", refusal=role == "assistant")
        if role == "assistant" and not text and isinstance(data.get("refusal"), str):
            text = data["refusal"]  # NOTE: the SDK's message.refusal sent back: what it said
        item: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                "content": text}
        for key in ("tool_calls", "tool_call_id"):  # NOTE: see coda.server.tool_messages
            if data.get(key):
                item[key] = data[key]
        name = data.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequestError(f"{field}.{i}.name must be a string",
                                          field=f"{field}.{i}.name")
            # NOTE: as transformers' apply_chat_template: the template sees ``message.name``
            # (ChatML and most templates ignore it; templates that use it render it).
            item["name"] = name
        out.append(item)
    return out


def _tool_turns(messages: Sequence[Any]) -> bool:
    """Whether any message is a tool result or carries tool calls (what
    :func:`coda.server.tool_messages.prepare` rewrites)."""
    def get(m: Any, key: str) -> Any:
        return m.get(key) if isinstance(m, Mapping) else getattr(m, key, None)

    return any(get(m, "tool_calls") or get(m, "role") == "tool" for m in messages)


def render_chat(engine: Engine, messages: Sequence[Any], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, field: str = "messages",
                tools: Sequence[Tool] = ()) -> str:
    """Render ``messages`` with the engine's chat template.

    With ``continue_final_message`` the last (assistant) message is left open, so the model
    continues it (Anthropic's assistant prefill). ``tools`` and tool history are handed to the
    template as :mod:`coda.server.tool_messages` describes."""
    import jinja2

    chat: TokenizerBundle = engine.chat
    # NOTE: issue 22: no tools and no tool turn: the tool module has nothing to prepare
    raw, template_tools = (prepare(messages, tools, chat.chat_template, field)
                           if tools or _tool_turns(messages) else (messages, None))
    msgs = normalise_messages(raw, field)
    prefill = ""
    if continue_final_message:
        if msgs[-1]["role"] != "assistant":
            raise InvalidRequestError("continue_final_message needs a final assistant message",
                                      field=field)
        prefill = msgs.pop()["content"]
        add_generation_prompt = True
    try:
        text = _compile(chat.chat_template).render(
            messages=msgs, add_generation_prompt=add_generation_prompt,
            bos_token=chat.bos_token, eos_token=chat.eos_token, tools=template_tools)
    except TemplateRaised as exc:
        raise InvalidRequestError(f"{field}: {exc}", field=field) from None
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"{field}: chat template failed: {exc}", field=field) from None
    return text + prefill
