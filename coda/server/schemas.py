"""Request bodies of the OpenAI-compatible endpoints, plus the Coda extension fields shared by
every protocol (issue 4 items 3 and 5; SPEC P4, G3, D1).

Unknown top-level fields are rejected (``extra="forbid"``) exactly like the upstream APIs do,
so a misspelt parameter is a 400 naming it, never silently ignored. Objects the protocols leave
open (chat messages, ``metadata``) allow extra keys. Range checks that need the model (vocab,
context, stop limits) happen later, in :mod:`coda.server.params` and the engine's ``submit``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

StopField = str | list[str] | None
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]
Verbosity = Literal["low", "medium", "high"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
StopTokenIds = list[int | list[int]] | None
# NOTE: OpenAI's (and Ollama's) seed is a signed 64-bit integer: past it is a 400 naming
# ``seed`` (P1), as they answer, and the same bound holds for Coda's seed on Anthropic and
# Responses (one rule); within it every value (negative ones too) seeds the counter RNG
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1


# NOTE: strict (issue "API gaps" item 2): a JSON ``true`` is never the integer 1 nor the number
# 1.0, and ``"5"`` is not 5, as the upstream APIs answer; an int is still a valid float.
STRICT = ConfigDict(extra="forbid", strict=True)
OPEN = ConfigDict(extra="allow", strict=True)


class _Strict(BaseModel):
    model_config = STRICT


# NOTE: fields OpenAI declares nullable whose null Coda's schema would refuse (a bool or an int
# with a default): an explicit null is the default, as upstream answers (P1). The official SDK
# sends null for an argument passed as None (``n=None``, ``logprobs=None``).
NULL_IS_DEFAULT = frozenset({"n", "stream", "logprobs", "echo", "store", "background"})


def null_is_default(data: Any, fields: Any) -> Any:
    """A request body with its NULL_IS_DEFAULT ``fields`` (the model's own) that are null
    left out (a field the endpoint lacks stays, and is refused as unknown)."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items()
                if v is not None or k not in NULL_IS_DEFAULT or k not in fields}
    return data


class BackpressureBody(_Strict):
    """P6: how a slow reader is handled (Coda extension)."""

    policy: Literal["pause", "buffer"] = "buffer"
    pause_bytes: int = Field(65536, ge=1)
    max_bytes: int = Field(4 * 1024 * 1024, ge=1, le=64 * 1024 * 1024)


class ResponseFormat(_Strict):
    """``text`` | ``json_object`` | ``json_schema`` (OpenAI) and ``regex`` | ``lark`` (Coda)."""

    type: Literal["text", "json_object", "json_schema", "regex", "lark"]
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    lark: str | None = None


class CodaExtensions(_Strict):
    """Fields every Coda endpoint accepts on top of its protocol (documented in docs/api.md).

    ``deadline`` (seconds from arrival) ends a request ``deadline_exceeded`` (G3, never
    "cancelled"); ``on_disconnect`` declares the P4 policy of a foreground request.
    """

    deadline: float | None = Field(None, gt=0, le=86400)
    include_stop_str_in_output: bool = False
    on_disconnect: Literal["cancel", "continue"] | None = None
    early_stop: dict[str, Any] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    stop_token_ids: StopTokenIds = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    backpressure: BackpressureBody | None = None
    response_format: ResponseFormat | None = None
    utf8_tail: Literal["auto", "fail", "drop"] = "auto"
    stream_verify: bool = False  # P3: byte offset + running digest on every delta
    # issue 13: structured output closes within max_tokens (None: on for json_schema and tools)
    close_within_budget: bool | None = None
    # issue 23: reasoning models (coda.reasoning): send the reasoning (False: split off
    # and dropped), and the reasoning budget (Anthropic: thinking.budget_tokens)
    include_reasoning: bool = True
    max_reasoning_tokens: int | None = Field(None, ge=0)
    # issue 21: false opts this request out of `coda serve --speculative` (docs/speculative.md)
    speculative: bool = True


class _OpenAISampling(CodaExtensions):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)  # NOTE: 0 as OpenAI (params.sampled_top_p)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stop: StopField = None
    user: str | None = None
    max_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return null_is_default(data, cls.model_fields)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    # NOTE: OpenAI's delta padding against size side channels; accepted, no effect (fields.py)
    include_obfuscation: bool = True


class TextPart(BaseModel):
    """A text content part; other part kinds (images, audio) are rejected by the renderer."""

    model_config = OPEN
    type: str
    text: str | None = None


class Prediction(_Strict):
    """Chat ``prediction`` (OpenAI's predicted outputs): the text the answer is expected to
    repeat, a string or text parts. It never changes the output: the engine drafts from it
    where it verifies exactly, and usage counts its accepted / rejected tokens
    (coda.server.prediction, docs/api.md)."""

    type: Literal["content"]
    content: str | list[TextPart]

    @model_validator(mode="after")
    def _text_parts(self) -> Prediction:
        if isinstance(self.content, list) and any(
                p.type != "text" or not isinstance(p.text, str) for p in self.content):
            raise ValueError("content parts must be text parts ({type: text, text})")
        return self


# NOTE: OpenAI's prompt cache retention policy; accepted, no effect: Coda's prefix cache keeps
# prefixes while memory allows, whatever is asked (docs/api.md)
PromptCacheRetention = Literal["in-memory", "24h"]


class ChatMessage(BaseModel):
    model_config = OPEN  # NOTE: the protocol allows name, refusal, ...
    role: str
    content: str | list[TextPart] | None = None
    # NOTE: typed so that a non-list is a 400 naming it (P1), never a TypeError (a 500) in
    # the tool-result pairing check; each call's own fields are checked there and in
    # coda.server.tool_messages
    tool_calls: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        # NOTE: as OpenAI: only an assistant message (calls, a refusal) may leave content
        # out; a user/system/developer/tool message without one was an empty turn
        if self.content is None and self.role in ("user", "system", "developer", "tool"):
            raise ValueError(f"content is required on a {self.role} message")
        return self


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # NOTE: accepted as OpenAI documents them (coda.server.fields says what each does here)
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: PromptCacheRetention | None = None
    safety_identifier: str | None = None
    prediction: Prediction | None = None
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Verbosity | None = None  # NOTE: accepted, no effect (docs/api.md)
    modalities: list[Literal["text", "audio"]] | None = None
    # NOTE: the deprecated function calling, translated to tools (coda.server.legacy_functions)
    functions: list[dict[str, Any]] | None = None
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    # NOTE: 0 only with echo (vLLM's prompt scoring; coda.server.echo), else a 400 at parse
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=16)


_OpenAISampling.model_rebuild()
Prediction.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
