"""Chat template rendering from ``tokenizer_config.json`` with jinja2 (issue 4 item 2).

The template runs in jinja2's sandbox with the helpers HF templates expect
(``raise_exception``, ``strftime_now``, ``bos_token``/``eos_token``). Roles are validated
before rendering; an error the template raises (e.g. "roles must alternate") is a 400 on the
``messages`` field, never a 5xx. A model without a template gets ChatML.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from coda.errors import InvalidRequestError

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TemplateRaised(Exception):
    """``raise_exception`` called by the template itself."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def _tojson(value: Any, indent: int | None = None) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, indent=indent)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # NOTE: some configs store AddedToken dicts
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def content_text(content: Any, field: str) -> str:
    """A message's content as plain text: a string, or text parts joined (others → 400)."""
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
        else:
            raise InvalidRequestError(
                f"{field}.content.{i}: only text content parts are supported (got {kind!r})",
                field=f"{field}.content")
    return "".join(parts)


def normalise_messages(messages: Sequence[Any], field: str = "messages",
                       roles: frozenset[str] = CHAT_ROLES) -> list[dict[str, str]]:
    """Validate roles and flatten content; ``developer`` renders as ``system``."""
    if not messages:
        raise InvalidRequestError(f"{field} must not be empty", field=field)
    out: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        data = msg if isinstance(msg, Mapping) else msg.model_dump()
        role = data.get("role")
        if role not in roles:
            raise InvalidRequestError(
                f"{field}.{i}.role must be one of {sorted(roles)}, got {role!r}",
                field=f"{field}.{i}.role")
        text = content_text(data.get("content"), f"{field}.{i}")
        entry = {"role": "system" if role == "developer" else role, "content": text}
        name = data.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequestError(f"{field}.{i}.name must be a string",
                                          field=f"{field}.{i}.name")
            # NOTE: as transformers' apply_chat_template: the template sees ``message.name``
            # (ChatML and most templates ignore it; templates that use it render it).
            entry["name"] = name
        out.append(entry)
    return out


def render_chat(engine: Any, messages: Sequence[Any], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, field: str = "messages") -> str:
    """Render ``messages`` with the engine's chat template.

    With ``continue_final_message`` the last (assistant) message is left open, so the model
    continues it (Anthropic's assistant prefill)."""
    msgs = normalise_messages(messages, field)
    tok_cfg: dict[str, Any] = getattr(engine, "tokenizer_config", {}) or {}
    source = tok_cfg.get("chat_template") or DEFAULT_TEMPLATE
    if isinstance(source, list):  # NOTE: multi-template configs: take the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), DEFAULT_TEMPLATE)
    prefill = ""
    if continue_final_message:
        if msgs[-1]["role"] != "assistant":
            raise InvalidRequestError("continue_final_message needs a final assistant message",
                                      field=field)
        prefill = msgs.pop()["content"]
        add_generation_prompt = True
    try:
        text = _compile(source).render(
            messages=msgs, add_generation_prompt=add_generation_prompt,
            bos_token=_token_text(tok_cfg.get("bos_token")),
            eos_token=_token_text(tok_cfg.get("eos_token")), tools=None)
    except TemplateRaised as exc:
        raise InvalidRequestError(f"{field}: {exc}", field=field) from None
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"{field}: chat template failed: {exc}", field=field) from None
    return text + prefill
