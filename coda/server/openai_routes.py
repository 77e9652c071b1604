"""``POST /v1/chat/completions`` and ``POST /v1/completions`` (issue 4 item 2; SPEC P1–P4, L4–L6).

The request checked and parsed into the engine call (the adapter) and the routes; the
non-streamed answer is :mod:`coda.server.openai_final`. Streams are ``chat.completion.chunk`` / ``text_completion`` events
(:mod:`coda.server.openai_stream`). Every final chunk or choice carries the closest OpenAI
``finish_reason`` and the exact outcome in ``coda`` (finish reason, matched stop, split usage,
timings).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from coda.engine.plan import fits_context
from coda.errors import InvalidRequestError
from coda.finish import Terminal
from coda.server import echo as ec
from coda.server import tools as tl
from coda.server.chat import render_chat
from coda.server.chat_store import stored_fields
from coda.server.common import create, new_id, state_of
from coda.server.fields import check_metadata, check_modalities, effort_budget, served_tier
from coda.server.http_errors import ApiError, api_error_from, failed_json, is_failed, openai_error
from coda.server.legacy_functions import has_legacy_history, legacy_history, legacy_tools
from coda.server.mapping import (
    coda_extension,
)
from coda.server.openai_checks import check_json_word_chat
from coda.server.openai_final import final_object
from coda.server.openai_stream import OpenAIRenderer
from coda.server.params import check_json_schema_format, plan_call, sampled_top_p
from coda.server.prediction import check_prediction, prediction_ids
from coda.server.records import Record, register_renderer
from coda.server.render_spec import OpenAIRender
from coda.server.schemas import ChatCompletionRequest, CompletionRequest
from coda.server.state import ServerState
from coda.server.tool_results import check_openai_results

router = APIRouter()

# NOTE: what an omitted ``max_tokens`` means on legacy completions: OpenAI's API reference
# ("Defaults to 16") and vLLM's CompletionRequest both say 16 (chat has no such default)
COMPLETIONS_MAX_TOKENS = 16


def _reject_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.stream_options is not None and not body.stream:
        # NOTE: as OpenAI: stream options without a stream are an error, never ignored.
        raise InvalidRequestError("stream_options: only allowed when stream is true",
                                  field="stream_options")
    if isinstance(body, ChatCompletionRequest):
        if body.metadata:  # NOTE: issue 22: a plain request never enters fields
            check_metadata(body.metadata)
        fmt = body.response_format
        if fmt is not None and fmt.type == "json_object":
            check_json_word_chat(body.messages)
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
            check_json_schema_format(fmt.json_schema, "response_format.json_schema")
        if body.prediction is not None:  # NOTE: OpenAI's limits beside one (400 naming each)
            check_prediction(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs: requires logprobs=true",
                                      field="top_logprobs")
        if (body.continue_final_message and body.add_generation_prompt
                and "add_generation_prompt" in body.model_fields_set):
            # NOTE: as vLLM: continuing the last assistant message and opening a new one
            # contradict; left out, add_generation_prompt (default true) asks for nothing
            raise InvalidRequestError(
                "continue_final_message, add_generation_prompt: cannot both be true (continue "
                "the last assistant message, or open a new one)", field="continue_final_message")
        return
    if body.suffix:
        raise InvalidRequestError("suffix: suffix is not supported", field="suffix")
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequestError("max_tokens: 0 is only allowed with echo: true (the prompt "
                                  "echoed, with its logprobs if asked, and no completion)",
                                  field="max_tokens")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError("best_of: only best_of == n is supported", field="best_of")


def _plain_chat(body: ChatCompletionRequest) -> bool:
    """No tools, functions, tool choice, parallel_tool_calls or modalities, and no tool or
    function turn in the history: the tool modules would find nothing to do (issue 22: a plain chat never enters
    them; ``_chat_tools`` of such a body is ``(None, messages, False)``)."""
    if (body.tools is not None or body.tool_choice is not None or body.functions is not None
            or body.function_call is not None or body.modalities is not None
            or body.parallel_tool_calls is not None):
        return False
    return all(m.role not in ("tool", "function") and getattr(m, "tool_calls", None) is None
               and getattr(m, "function_call", None) is None for m in body.messages)


def _chat_tools(body: ChatCompletionRequest
                ) -> tuple[tl.ToolPlan | None, list[Any], bool]:
    """The chat request's tool plan (legacy ``functions`` translated), its messages (legacy
    function turns translated) with every tool result checked against the calls it answers,
    and whether the answer takes the legacy ``function_call`` shape."""
    if _plain_chat(body):
        return None, list(body.messages), False
    check_modalities(body.modalities)
    if body.functions is None:  # NOTE: the legacy style checks its own fields
        tl.check_chat_fields(body.tools, body.tool_choice, body.parallel_tool_calls)
    tools, choice, legacy = legacy_tools(body.functions, body.function_call, body.tools,
                                         body.tool_choice)
    messages: list[Any] = (legacy_history(body.messages) if has_legacy_history(body.messages)
                           else list(body.messages))
    check_openai_results(messages)
    # NOTE: a legacy answer holds one call (message.function_call), so never parallel calls
    plan = tl.openai_plan(tools, choice, False if legacy else body.parallel_tool_calls)
    return plan, messages, legacy


def _prompts(st: ServerState, body: ChatCompletionRequest | CompletionRequest,
             plan: tl.ToolPlan | None = None, messages: Sequence[Any] = ()
             ) -> list[list[int]]:
    """The prompts' token ids (CPU-bound: runs on a worker thread, never on the event loop)."""
    engine = st.engine
    if isinstance(body, ChatCompletionRequest):
        text = render_chat(engine, messages or body.messages,
                           add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message,
                           tools=plan.tools if plan else ())
        return [st.encode(text, add_special_tokens=False, field="messages")]
    p = body.prompt
    if isinstance(p, str):
        return [st.encode(p, add_special_tokens=True)]
    if not p:
        raise InvalidRequestError("prompt: must not be empty", field="prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    out = []
    items: list[str | list[int]] = list(p)  # type: ignore[arg-type]
    for k, item in enumerate(items):
        try:
            out.append(st.encode(item, add_special_tokens=True) if isinstance(item, str)
                       else list(item))
        except InvalidRequestError as exc:  # NOTE: a batch's error names its prompt's index
            raise api_error_from(exc, prompt=k if len(p) > 1 else None) from None
    return out


def _budget_field(body: ChatCompletionRequest | CompletionRequest) -> tuple[int | None, str]:
    """L4: the OpenAI wire's output budget under its one name, with the field it came in
    (errors about the budget name it): this adapter's one mapping, for both routes. Legacy
    completions have ``max_tokens`` alone; chat either ``max_completion_tokens`` or its older
    name ``max_tokens``, and the wire's own rules on which field carries it are checked here
    (as OpenAI: both sent is a 400 naming ``max_tokens``, neither silently winning;
    ``max_completion_tokens`` is refused beside a prediction). The budget's range and room
    are the plan's one check (:func:`coda.engine.plan.plan_request`)."""
    if isinstance(body, CompletionRequest) or not body.max_completion_tokens:
        return body.max_tokens, "max_tokens"
    if body.prediction is not None:
        raise InvalidRequestError("max_completion_tokens: not supported with prediction "
                                  "(OpenAI's predicted outputs); use max_tokens",
                                  field="max_completion_tokens")
    if body.max_tokens:  # NOTE: both sent (each >= 1)
        raise ApiError(400, "max_tokens and max_completion_tokens: send one of them, not both "
                       "(max_tokens is the older name of max_completion_tokens)",
                       param="max_tokens", code="invalid_parameter_combination")
    return body.max_completion_tokens, "max_completion_tokens"


def _completion_budget(st: ServerState, max_tokens: int | None,
                       prompts: Sequence[Sequence[int]]) -> int | None | tuple[int | None, ...]:
    """A legacy completion's budget: as asked; omitted, each prompt's own: the wire's default
    :data:`COMPLETIONS_MAX_TOKENS` where the context has room for it after that prompt (the
    plan's own rule), else None — omitted, so the plan bounds it by the context and it ends
    ``context_limit`` rather than being refused for a limit the client never sent."""
    if max_tokens is not None:
        return max_tokens
    ctx = st.engine.context_length
    return tuple(COMPLETIONS_MAX_TOKENS if fits_context(len(p), COMPLETIONS_MAX_TOKENS, ctx)
                 else None for p in prompts)


class OpenAIAdapter:
    """Chat completions or legacy completions as a :class:`~coda.server.common.Adapter`."""

    id_header = "x-request-id"

    def __init__(self, kind: Literal["chat", "completion"], id_prefix: str) -> None:
        self.kind: Literal["chat", "completion"] = kind
        self.id_prefix = id_prefix

    async def parse(self, st: ServerState,
                    body: ChatCompletionRequest | CompletionRequest) -> Record:
        st.check_model(body.model)
        _reject_unsupported(body)
        chat = isinstance(body, ChatCompletionRequest)
        plan, messages, legacy = _chat_tools(body) if isinstance(
            body, ChatCompletionRequest) else (None, [], False)
        max_tokens, mt_field = _budget_field(body)
        if isinstance(body, ChatCompletionRequest):
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            logprobs = body.logprobs
        tool = tl.knob_fields(plan, body.response_format) if plan is not None else {}
        prompts = await asyncio.to_thread(_prompts, st, body, plan, messages)  # NOTE: CPU-bound
        asked = max_tokens if chat else _completion_budget(st, max_tokens, prompts)
        reasoning = None
        if isinstance(body, ChatCompletionRequest):
            # NOTE: issue 22: fields only with an effort to map; coda.reasoning only with a
            # budget to check or a model with markers (ServerState.reasoning); a grammar
            # (tools, response_format) constrains the answer only, after the reasoning
            budget = (body.max_reasoning_tokens if body.reasoning_effort is None
                      else effort_budget(st.engine.tokenizer, body.reasoning_effort,
                                         body.max_reasoning_tokens))
            reasoning = st.reasoning(prompts[0], budget=budget,
                                     budget_field="max_reasoning_tokens")
        elif body.max_reasoning_tokens is not None:
            raise InvalidRequestError("max_reasoning_tokens: only for chat completions",
                                      field="max_reasoning_tokens")
        predicted = (await asyncio.to_thread(prediction_ids, st.engine.tokenizer,
                                             body.prediction)
                     if isinstance(body, ChatCompletionRequest)
                     and body.prediction is not None else None)
        options = body.stream_options
        call_id = new_id(self.id_prefix)
        echo: tuple[str, ...] = ()
        echo_lp: tuple[dict[str, Any], ...] = ()
        if isinstance(body, CompletionRequest) and body.echo:
            echo, echo_lp = await ec.echo_parts(st, body, prompts, call_id)
        spec = OpenAIRender(
            n=body.n, prompt_tokens=tuple(len(p) for p in prompts),
            tools=bool(plan and plan.active), skip_special=body.skip_special_tokens,
            verify=body.stream_verify, logprobs=logprobs is not None,
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.continuous_usage_stats),
            reasoning=body.include_reasoning,
            echo=echo, echo_logprobs=echo_lp,
            service_tier=(served_tier(body.service_tier)
                          if isinstance(body, ChatCompletionRequest)
                          and body.service_tier is not None else None),
            legacy_functions=legacy, prediction=isinstance(body, ChatCompletionRequest)
            and body.prediction is not None,
            **(stored_fields(body) if isinstance(body, ChatCompletionRequest) and body.store
               else {}))
        # NOTE: the parse's one call into params, with the protocol's resolved values
        return plan_call(body, prompts, spec, call_id=call_id,
                         kind=self.kind, model=st.engine.model_name,
                         backpressure=st.settings.backpressure, stream=body.stream,
                         on_disconnect=body.on_disconnect,
                         keep=not (isinstance(body, ChatCompletionRequest)
                                   and body.store is False),
                         max_tokens=asked, max_tokens_field=mt_field,
                         prompt_field="messages" if chat else "prompt", stop=body.stop,
                         n=body.n, seed=body.seed, temperature=body.temperature,
                         top_p=sampled_top_p(body.top_p), presence_penalty=body.presence_penalty,
                         frequency_penalty=body.frequency_penalty, logit_bias=body.logit_bias,
                         logprobs=logprobs,
                         logprobs_field="top_logprobs" if chat else "logprobs",
                         prediction=predicted,
                         reasoning=reasoning, **tool)

    def final(self, record: Record, terminals: list[Terminal] | None) -> Response:
        assert terminals is not None and isinstance(record.spec, OpenAIRender)
        headers = {"x-request-id": record.id}
        answer = final_object(record, terminals, record.spec)
        failed = [t for t in terminals if is_failed(t)]
        if failed:  # defect 4: an error status that carries the partial text and the outcome
            answer = {"error": openai_error(failed[0]), **answer,
                      "coda": coda_extension(failed[0])}
            return failed_json(answer, failed[0], headers=headers)
        return JSONResponse(answer, headers=headers)


CHAT = OpenAIAdapter("chat", "chatcmpl-")
COMPLETIONS = OpenAIAdapter("completion", "cmpl-")
register_renderer(OpenAIRender, OpenAIRenderer)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI chat completions (streaming and not) with the Coda extensions."""
    return await create(request, await CHAT.parse(state_of(request), body), CHAT)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI legacy completions (prompt text or token ids, legacy logprobs)."""
    return await create(request, await COMPLETIONS.parse(state_of(request), body), COMPLETIONS)
