"""What a protocol's renderer needs beyond the engine's streams, as typed frozen values
(issue 22 step 2; SPEC P3).

Each create route's adapter (:mod:`coda.server.common`) turns the body into one of these; the
record keeps it and every renderer of the record — the first delivery, a resume, a replay on
another ingress from the durable log — is rebuilt from it alone, so a replay renders the same
frames (P3). :func:`spec_data` / :func:`spec_from_data` are its plain-data form in the stream
log's record descriptor (the field names are the descriptor's keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

RecordKind = Literal["chat", "completion", "anthropic", "response", "ollama"]


@dataclass(frozen=True)
class OpenAIRender:
    """Chat and legacy completions: ``n`` choices per prompt, each prompt's token count
    (``continuous_usage``), and the options that shape the chunks."""

    n: int
    prompt_tokens: tuple[int, ...]
    tools: bool = False
    skip_special: bool = True
    verify: bool = False
    include_usage: bool = False
    logprobs: bool = False
    continuous_usage: bool = False
    reasoning: bool = True  # issue 23: render reasoning deltas (False: drop them)
    # legacy ``echo``: each prompt's text, put before its choices' text (empty: no echo)
    echo: tuple[str, ...] = ()
    # echo with logprobs: each prompt's legacy logprobs (coda.server.echo)
    echo_logprobs: tuple[Mapping[str, object], ...] = ()
    # ``service_tier`` reported on the answer and every chunk (None: not asked, not reported)
    service_tier: str | None = None
    # the deprecated ``functions``: a call is ``function_call``, not ``tool_calls``
    # (coda.server.legacy_functions)
    legacy_functions: bool = False
    # chat ``prediction`` sent: usage reports its accepted / rejected tokens (the terminal's)
    prediction: bool = False
    # chat ``store: true``: a stored completion (coda.server.chat_store): retrievable, listed,
    # its ``metadata`` echoed (and updatable), its request ``messages`` listed as sent
    stored: bool = False
    metadata: Mapping[str, str] = field(default_factory=dict)
    messages: tuple[Mapping[str, object], ...] = ()


@dataclass(frozen=True)
class AnthropicRender:
    """Messages: the prompt's token count (``message_start`` usage) and the options."""

    input_tokens: int
    tools: bool = False
    verify: bool = False
    # issue 23: the output is split (the model has reasoning markers): blocks open lazily, a
    # thinking block first; ``reasoning`` False drops the reasoning (thinking disabled)
    thinking: bool = False
    reasoning: bool = True
    # NOTE: thinking.display "omitted": thinking blocks sent with empty text (anthropic_checks)
    omit_thinking: bool = False
    service_tier: str | None = None  # NOTE: ``usage.service_tier`` when asked ("standard")
    speed: str | None = None  # NOTE: ``usage.speed`` when asked (the one local speed)
    # NOTE: ``max_tokens: 0`` (Anthropic's cache pre-warming): the prompt prefilled, no
    # output, so no content block at all (the message's content is empty)
    warm: bool = False


@dataclass(frozen=True)
class ResponsesRender:
    """Responses: the request's echoed fields (the response object repeats them) and options.
    ``format`` / ``tools_echo`` / ``tool_choice`` are the client's JSON, echoed unchanged."""

    format: Mapping[str, object]
    verbosity: str = "medium"  # NOTE: ``text.verbosity`` as sent (OpenAI's default when not)
    instructions: str | None = None
    # NOTE: echoed as OpenAI's response object does (the SDK's ``previous_response_id``)
    previous_response_id: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    max_tokens: int | None = None  # NOTE: echoed as the wire's ``max_output_tokens``
    temperature: float | None = None
    top_p: float | None = None
    tools: bool = False
    tools_echo: tuple[object, ...] = ()
    parallel: bool = False
    tool_choice: object = "auto"
    store: bool = True
    logprobs: bool = False
    verify: bool = False
    # issue 23: the output is split and its reasoning shown: a ``reasoning`` output item
    # before the message (False: no split, or its reasoning dropped)
    thinking: bool = False
    # issue 24 item 3: the conversation this response answered (the inherited history and
    # its input as messages, instructions excluded): what ``previous_response_id`` continues
    history: tuple[Mapping[str, object], ...] = ()
    service_tier: str | None = None  # NOTE: reported when asked (coda.server.fields)
    # what ``GET /v1/responses/{id}/input_items`` lists (coda.server.responses_items): the
    # items a continuation carried over, with their ids, then the request's own ``input`` as
    # sent (a string, or its items), whose ids derive from the response's (never stored)
    carried_items: tuple[Mapping[str, object], ...] = ()
    own_input: str | tuple[Mapping[str, object], ...] = ()
    skip_special: bool = True  # NOTE: a skipped special token's logprob entry has no bytes
    # the request's informational fields the response object repeats as sent (P1: ``user``,
    # ``safety_identifier``, ``prompt_cache_key``, ``top_logprobs``, ``reasoning``), null
    # where not sent; a record stored before it had none: they are left out
    echoed: Mapping[str, object] = field(default_factory=dict)
    # the request's ``truncation`` as sent (echoed; "disabled" when not sent) and how many input
    # items "auto" dropped to fit the context (coda.server.responses_fit; the ``coda`` object)
    truncation: str = "disabled"
    dropped_items: int = 0


@dataclass(frozen=True)
class OllamaRender:
    """Ollama ``/api/chat`` (``chat``: a ``message`` per line) or ``/api/generate`` (a
    ``response`` per line); the model name as the client asked for it, and the options."""

    chat: bool
    model: str
    tools: bool = False
    thinking: bool = False  # NOTE: issue 23: the reasoning split shown as ``thinking``
    logprobs: bool = False  # NOTE: each line carries its tokens' ``logprobs``
    skip_special: bool = True  # NOTE: a skipped special token's logprob entry has no bytes
    # generate: the prompt's token ids (a request's ``context`` first): the done line's
    # ``context`` is these, then the output's ids (coda.server.ollama_context)
    prompt_ids: tuple[int, ...] = ()


RenderSpec = OpenAIRender | AnthropicRender | ResponsesRender | OllamaRender

_BY_KIND: dict[str, type[OpenAIRender] | type[AnthropicRender] | type[ResponsesRender]
               | type[OllamaRender]] = {
    "chat": OpenAIRender, "completion": OpenAIRender, "anthropic": AnthropicRender,
    "response": ResponsesRender, "ollama": OllamaRender}


def spec_data(spec: RenderSpec) -> dict[str, object]:
    """The plain-data form written to the durable log."""
    return asdict(spec)


def spec_from_data(kind: str, data: Mapping[str, object]) -> RenderSpec:
    """Rebuild a record's spec from its descriptor (KeyError on an unknown kind; fields the
    descriptor lacks take their defaults)."""
    cls = _BY_KIND[kind]
    # NOTE: JSON/msgpack turn tuples into lists; the frozen spec keeps tuples
    values = {f.name: tuple(v) if isinstance(v := data[f.name], list) else v
              for f in fields(cls) if f.name in data}
    return cls(**values)  # type: ignore[arg-type]
