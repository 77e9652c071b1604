"""Request bodies of the Ollama API (``/api/chat``, ``/api/generate``, ``/api/show``,
``/api/embed``; issue 23 item 2) and how ``options`` and ``format`` become Coda's knobs.

``options``: :mod:`coda.server.ollama_options` (what each option means here).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from coda.engine.types import GrammarSpec
from coda.errors import InvalidRequestError
from coda.server.ollama_options import OllamaOptions
from coda.server.schemas import OPEN, STRICT, CodaExtensions


def null_as_unset(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """A JSON ``null`` reads as the field left out, as Go's decoder reads it into Ollama's
    request (the zero value; ``stream``, a pointer there, unset: streamed). Without this a
    ``"stream": null`` or ``"content": null`` was a 400 while ``"format": null`` passed."""
    if value is None and info.field_name is not None:
        return cls.model_fields[info.field_name].get_default(call_default_factory=True)
    return value


class OllamaToolFunction(BaseModel):
    """A call's ``function``: as Ollama decodes it, ``arguments`` is an object (a JSON string
    there is a 400, as Ollama's decoder refuses one), and Coda wants the ``name`` it renders."""

    model_config = OPEN  # NOTE: a history echoed back may carry fields of newer servers
    name: str = Field(min_length=1)
    arguments: dict[str, Any] | None = None  # NOTE: null = no arguments, as Ollama reads it
    index: int | None = None


class OllamaToolCall(BaseModel):
    """One entry of an assistant message's ``tool_calls`` (what ``/api/chat`` answered)."""

    model_config = OPEN
    function: OllamaToolFunction
    id: str | None = None


class OllamaMessage(BaseModel):
    """One chat message; ``images`` are refused (no vision model is served).

    Tool messages (the API-gaps issue item 4) as Ollama takes them: ``{"role": "tool",
    "content": "<result>", "tool_name": "<function>"}`` (``tool_name`` optional), rendered
    through the model's template like any tool result. The shapes a template would silently
    drop or misrender are a 400 in Ollama's error shape instead (P1): ``tool_calls`` on a
    message other than the assistant's (only an assistant calls), ``tool_name`` on a message
    other than a tool result, a call without ``function.name``, or ``arguments`` that are not
    an object. Ollama itself does not pair a result with a call (it has no call ids), so
    neither does Coda here."""

    model_config = STRICT
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None
    _nulls = field_validator("content", mode="before")(classmethod(null_as_unset))

    @model_validator(mode="after")
    def _tool_fields_where_they_mean_something(self) -> OllamaMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message carries tool calls "
                             f"(this one is {self.role!r}); a tool result is a message "
                             '{"role": "tool", "content": ..., "tool_name": ...}')
        if self.tool_name and self.role != "tool":
            raise ValueError(f"tool_name: only a tool result (role 'tool') names its tool "
                             f"(this message is {self.role!r})")
        return self

    def template_calls(self) -> list[dict[str, Any]] | None:
        """``tool_calls`` as plain data for the chat template (None when absent)."""
        calls = [c.model_dump(exclude_none=True) for c in self.tool_calls or ()]
        for c in calls:  # NOTE: null or left out: no arguments, as Ollama reads it
            c["function"].setdefault("arguments", {})
        return calls or None


# NOTE: Go's time.ParseDuration, which Ollama's keep_alive string goes through: signed, one or
# more decimal numbers each with its unit ("300ms", "1.5h", "2h45m"); "0" alone needs none
_DURATION_PART = re.compile(r"([0-9]*(?:\.[0-9]*)?)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
           "h": 3600.0}


def duration_s(text: str) -> float:
    """A Go duration string in seconds; ValueError in Go's words ("time: invalid duration
    \"abc\"", "time: missing unit in duration \"10\"") where Go refuses it."""
    body = text[1:] if text[:1] in "+-" else text
    if body == "0":
        return 0.0
    total, pos = 0.0, 0
    while pos < len(body) or pos == 0:
        m = _DURATION_PART.match(body, pos)
        if m is None or m.group(1) in ("", "."):
            digits = re.fullmatch(r"[0-9]*(?:\.[0-9]*)?", body[pos:])
            why = "missing unit in" if body[pos:] and digits and body[pos:] != "." else "invalid"
            raise ValueError(f'time: {why} duration "{text}"')
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    return -total if text[:1] == "-" else total


def keep_alive_value(value: float | str | None) -> float | str | None:
    """``keep_alive`` as Ollama reads it: a number (seconds; negative: forever) or a Go
    duration string; another string is a 400 in Go's words, as Ollama answers (it was
    accepted and ignored)."""
    if isinstance(value, str):
        duration_s(value)
    return value


def model_name(name: str) -> str:
    """Ollama's implicit tag: ``name:latest`` is ``name`` (tools append it to every name); for
    routing only: an answer echoes the name as sent."""
    return name.removesuffix(":latest")


class _OllamaCreate(CodaExtensions):
    """Fields shared by ``/api/chat`` and ``/api/generate`` (plus the Coda extensions).

    ``model`` is kept as the request spelled it: the answer's ``model`` echoes it, as Ollama's
    handlers echo ``req.Model`` (``llama3:latest`` in, ``llama3:latest`` out; P1); routing
    reads it without the implicit tag (:func:`model_name`)."""

    model: str
    format: str | dict[str, Any] | None = None
    options: OllamaOptions | None = None
    stream: bool = True  # NOTE: Ollama streams unless told not to
    keep_alive: float | str | None = None
    _keep_alive = field_validator("keep_alive")(keep_alive_value)
    think: bool | str | None = None
    # NOTE: as Ollama (and OpenAI chat): each output token's logprob, and the k best beside
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    _nulls = field_validator("stream", "logprobs", mode="before")(classmethod(null_as_unset))

    @model_validator(mode="after")
    def _options_into_extensions(self) -> _OllamaCreate:
        """The options Coda keeps among its extension fields move there (one meaning)."""
        o = self.options
        if o is None:
            return self
        for ours, theirs in (("top_k", "top_k"), ("min_p", "min_p"),
                             ("repetition_penalty", "repeat_penalty")):
            value = getattr(o, theirs)
            if value is None:
                continue
            if getattr(self, ours) is not None:
                raise ValueError(f"{ours} and options.{theirs} both given; use options")
            setattr(self, ours, value)
        return self

    def grammar(self) -> GrammarSpec | None:
        """``format``: ``"json"`` (any JSON object) or a JSON schema → Coda's grammar."""
        fmt = self.format
        if fmt is None or fmt == "":
            return None
        if fmt == "json":
            return GrammarSpec(json_object=True)
        if isinstance(fmt, dict):
            return GrammarSpec(json_schema=fmt)
        raise InvalidRequestError(f'format: must be "json" or a JSON schema, got {fmt!r}',
                                  field="format")


class OllamaChatRequest(_OllamaCreate):
    messages: list[OllamaMessage] = Field(default_factory=list)
    _messages_null = field_validator("messages", mode="before")(classmethod(null_as_unset))
    tools: list[dict[str, Any]] | None = None
    # NOTE: Coda extension (Ollama has none): Chat Completions' values, default "auto"
    tool_choice: str | dict[str, Any] | None = None


class OllamaGenerateRequest(_OllamaCreate):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None
    _generate_nulls = field_validator("prompt", "raw", mode="before")(classmethod(null_as_unset))


class OllamaShowRequest(BaseModel):
    model_config = OPEN  # NOTE: ``verbose`` and older ``name``
    model: str | None = None
    name: str | None = None


class OllamaEmbedRequest(BaseModel):
    """``/api/embed`` (``input``) and the older ``/api/embeddings`` (``prompt``). ``options``
    are checked as everywhere and change nothing of an embedding; ``truncate`` (default on)
    cuts an input to the context, off it is a 400."""

    model_config = STRICT
    model: str  # NOTE: as sent, echoed; routed by model_name (see _OllamaCreate)
    input: str | list[str] = ""
    prompt: str | None = None
    truncate: bool = True
    _nulls = field_validator("input", "truncate", mode="before")(classmethod(null_as_unset))
    dimensions: int | None = Field(None, ge=1)
    options: OllamaOptions | None = None
    keep_alive: float | str | None = None
    _keep_alive = field_validator("keep_alive")(keep_alive_value)
