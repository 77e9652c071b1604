"""Request bodies of ``POST /v1/responses`` and ``POST /v1/messages`` (issue 4 items 2, 5).

Both reuse :class:`~coda.server.schemas.CodaExtensions`, so the Coda fields (deadline,
on_disconnect, early_stop, ...) mean the same thing on every endpoint.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator

from coda.server.schemas import (
    NULL_IS_DEFAULT,
    OPEN,
    SEED_MAX,
    SEED_MIN,
    STRICT,
    CodaExtensions,
    PromptCacheRetention,
    ResponseFormat,
    ServiceTier,
    StopField,
    Verbosity,
)

# NOTE: the values OpenAI documents for Responses ``include`` (the SDK's ResponseIncludable);
# another is a 400 naming ``include`` (P1). Only the logprobs one changes what Coda answers:
# the others ask for tool outputs, images or encrypted reasoning that Coda never produces.
ResponseIncludable = Literal[
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs", "reasoning.encrypted_content",
    "message.output_text.logprobs"]


class InputMessage(BaseModel):
    """A Responses ``input`` item of type ``message`` (``type`` may be omitted)."""

    model_config = OPEN
    type: Literal["message"] = "message"
    role: str
    content: str | list[dict[str, Any]]


class InputToolItem(BaseModel):
    """A Responses ``function_call`` (a call the model made) or ``function_call_output`` (its
    result) input item (issue 13)."""

    model_config = OPEN
    type: Literal["function_call", "function_call_output"]
    call_id: str
    name: str | None = None
    arguments: str | None = None
    # NOTE: as OpenAI: a string, or content parts (text ones here: coda.server.tool_messages)
    output: str | list[dict[str, Any]] | None = None


class InputReasoningItem(BaseModel):
    """A ``reasoning`` input item: an earlier output's reasoning sent back (OpenAI's manual
    conversation state, ``input += response.output``). Left out of the prompt, as a
    ``previous_response_id`` continuation leaves it (chat templates drop earlier reasoning)."""

    model_config = OPEN
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = []


class _OtherItem(BaseModel):
    """An input item of a type Coda does not take: refused naming ``input.N.type``."""

    model_config = OPEN
    type: str

    @field_validator("type")
    @classmethod
    def _refuse(cls, kind: str) -> str:
        raise ValueError(f"input items of type {kind!r} are not supported: Coda takes "
                         "message (the default), function_call, function_call_output and "
                         "reasoning items (no item_reference, image, file or built-in tool "
                         "items)")


_ITEM_TAGS = {"message": "[message]", "function_call": "[tool]",
              "function_call_output": "[tool]", "reasoning": "[reasoning]"}


def _item_tag(item: Any) -> str | None:
    """The input item's schema by its ``type`` (none: a message); None for an item that is
    not an object, so a bad item is refused naming itself (``input.N``, ``input.N.type``),
    not as the string ``input`` might have been."""
    if not isinstance(item, dict):  # NOTE: a built item (InputMessage, ...) or no object
        kind = getattr(item, "type", None)
        return _ITEM_TAGS.get(kind) if isinstance(kind, str) else None
    kind = item.get("type") or "message"
    return _ITEM_TAGS.get(kind, "[other]") if isinstance(kind, str) else "[other]"


# NOTE: the tags are bracketed so an error's field name drops them (validation_words._loc_name)
InputItem = Annotated[
    Annotated[InputMessage, Tag("[message]")] | Annotated[InputToolItem, Tag("[tool]")]
    | Annotated[InputReasoningItem, Tag("[reasoning]")]
    | Annotated[_OtherItem, Tag("[other]")],
    Discriminator(_item_tag, custom_error_type="invalid_input_item", custom_error_message=(
        "an input item must be an object (a message, function_call, function_call_output "
        "or reasoning item)"))]
ResponsesInput = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[InputItem], Tag("list")],
    Discriminator(lambda v: "list" if isinstance(v, list | tuple) else "str")]


class TextFormat(BaseModel):
    model_config = OPEN  # NOTE: name/strict/description are informative
    type: Literal["text", "json_object", "json_schema", "regex", "lark"] = "text"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    regex: str | None = None
    lark: str | None = None


class TextConfig(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None
    # NOTE: OpenAI's hint for how long an answer should be; accepted and echoed (the response
    # object's ``text.verbosity``), no effect: the served models take no such control
    verbosity: Verbosity | None = None


class ResponsesStreamOptions(BaseModel):
    model_config = STRICT
    # NOTE: OpenAI's delta padding against size side channels; accepted, no effect (fields.py)
    include_obfuscation: bool = True


class ResponsesRequest(CodaExtensions):
    model: str
    input: ResponsesInput
    instructions: str | None = None
    # NOTE: as OpenAI: at least 16 (Chat and Completions take any positive budget)
    max_output_tokens: int | None = Field(None, ge=16)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)  # NOTE: 0 as OpenAI (params.sampled_top_p)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[ResponseIncludable] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    background: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextConfig | None = None
    stop: StopField = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = None
    # issue 23: ``effort`` maps onto the reasoning budget on a reasoning model
    # (coda.server.fields), no summary is generated (docs/api.md)
    reasoning: dict[str, Any] | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: PromptCacheRetention | None = None
    safety_identifier: str | None = None
    # NOTE: the most function calls the output may hold: the tool grammar admits no more
    # (coda.server.tool_grammar.grammar_for); 0 is tool_choice "none"
    max_tool_calls: int | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        # NOTE: as schemas.null_is_default, inline: a plain request runs no code of schemas.py
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if v is not None or k not in NULL_IS_DEFAULT or k not in cls.model_fields}
        return data


class AnthropicMessage(BaseModel):
    model_config = STRICT
    role: str
    content: str | list[dict[str, Any]]


class AnthropicMetadata(BaseModel):
    model_config = STRICT  # NOTE: as Anthropic: user_id is its one field; another is a 400
    user_id: str | None = Field(None, max_length=256)  # NOTE: Anthropic's bound


class AnthropicDiagnostics(BaseModel):
    model_config = STRICT  # NOTE: the SDK's DiagnosticsParam: previous_message_id, its one key
    previous_message_id: str | None = None


class AnthropicRequest(CodaExtensions):
    model: str
    # NOTE: 0 warms the prefix cache: the prompt prefilled, no output (Anthropic's cache
    # pre-warming; coda.server.anthropic_routes)
    max_tokens: int = Field(..., ge=0)
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: AnthropicMetadata | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # NOTE: format → the grammar, effort accepted (coda.server.anthropic_request)
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # NOTE: the beta's older output_config.format
    # NOTE: accepted, no effect needed: Coda caches prompt prefixes automatically (docs/api.md).
    cache_control: dict[str, Any] | None = None
    # NOTE: accepted; one local tier, reported as usage.service_tier "standard" (docs/api.md)
    service_tier: Literal["auto", "standard_only"] | None = None
    # NOTE: accepted hints (docs/api.md): one local speed, reported as usage.speed "standard";
    # the region is this machine's; Coda compares no prompts (message diagnostics: null)
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    diagnostics: AnthropicDiagnostics | None = None
    # NOTE: what Coda cannot do: a 400 each when set (anthropic_request.check_unserved)
    container: str | dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    # NOTE: a message thread (server-held conversation state): the SDK's "cannot thread" 400
    thread: dict[str, Any] | None = None
    # NOTE: top_k is Anthropic's own field (CodaExtensions declares it): here >= 0 as
    # Anthropic answers (P1); 0 is "off" as before, the -1 of other protocols is a 400
    top_k: int | None = Field(None, ge=0)


class AnthropicCountRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: what shapes the prompt, nothing that samples."""

    model_config = OPEN
    model: str
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # NOTE: checked as on create (coda.server.anthropic_request.check_output), counted as
    # nothing: a format constrains the output, the prompt is the same
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None


class ResponsesCountRequest(BaseModel):
    """``POST /v1/responses/input_tokens`` (the SDK's ``responses.input_tokens.count``): the
    fields that shape a response's prompt, typed as :class:`ResponsesRequest` has them."""

    model_config = STRICT
    model: str | None = None  # NOTE: optional, as OpenAI's: the served model
    input: ResponsesInput | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None


__all__ = ["AnthropicCountRequest", "AnthropicRequest", "ResponseFormat",
           "ResponsesCountRequest", "ResponsesRequest", "TextFormat"]
