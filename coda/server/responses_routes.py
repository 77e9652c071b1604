"""The OpenAI Responses API: ``POST /v1/responses`` (+ ``background``) (issue 4 item 2; SPEC
P1–P4, C1, L2–L5): the request parsed and checked into the engine call (the adapter), and the
route. The response object is :mod:`coda.server.responses_object`, its event stream
:mod:`coda.server.responses_stream`; retrieve, replay, cancel, delete and input items are
:mod:`coda.server.responses_manage`.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, Literal

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from coda.engine.plan import check_prompt_room
from coda.engine.types import GrammarSpec
from coda.errors import ContextLengthExceededError, InvalidRequestError
from coda.finish import Terminal
from coda.server import tools as tl
from coda.server.chat import render_chat
from coda.server.common import create, new_id, state_of
from coda.server.fields import (
    check_metadata,
    effort_budget,
    reject_unhonoured,
    responses_effort,
    served_tier,
)
from coda.server.http_errors import api_error_from, failed_json, is_failed
from coda.server.openai_checks import check_json_word_responses
from coda.server.params import check_json_schema_format, plan_call, sampled_top_p
from coda.server.protocol_schemas import (
    InputMessage,
    InputToolItem,
    ResponsesCountRequest,
    ResponsesRequest,
    TextFormat,
)
from coda.server.records import Record, register_renderer
from coda.server.render_spec import ResponsesRender
from coda.server.responses_history import previous_history
from coda.server.responses_object import response_object
from coda.server.responses_stream import ResponsesRenderer
from coda.server.state import ServerState
from coda.server.tool_messages import tool_history_item
from coda.server.tool_results import check_responses_results

router = APIRouter()
_ROLES = frozenset({"system", "developer", "user", "assistant"})


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*msgs, {"role": "user", "content": body.input}]
    if not body.input:
        raise InvalidRequestError("input: must not be empty", field="input")
    for i, item in enumerate(body.input):
        if isinstance(item, InputToolItem):
            msgs += tool_history_item(item.model_dump(), f"input.{i}")
            continue
        if not isinstance(item, InputMessage):
            # NOTE: a reasoning item: earlier reasoning is no prompt text, as in a
            # previous_response_id continuation (no other item validates: protocol_schemas)
            continue
        if item.role not in _ROLES:
            raise InvalidRequestError(f"input.{i}.role must be one of {sorted(_ROLES)}",
                                      field=f"input.{i}.role")
        msgs.append({"role": item.role, "content": item.content})
    return msgs


def _grammar(fmt: TextFormat | None) -> GrammarSpec | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec(json_object=True)
    if fmt.type == "json_schema":
        check_json_schema_format({**(fmt.model_extra or {}), "schema": fmt.schema_},
                                 "text.format", frozenset({"type"}))
        if not isinstance(fmt.schema_, dict):
            raise InvalidRequestError("text.format.schema is required", field="text.format.schema")
        return GrammarSpec(json_schema=fmt.schema_)
    value = fmt.regex if fmt.type == "regex" else fmt.lark
    if not value:
        raise InvalidRequestError(f"text.format.{fmt.type} is required",
                                  field=f"text.format.{fmt.type}")
    return GrammarSpec(regex=fmt.regex) if fmt.type == "regex" else GrammarSpec(lark=fmt.lark)


def _prompt_ids(st: ServerState, msgs: list[dict[str, Any]],
                plan: tl.ToolPlan | None) -> list[int]:
    """The input's token ids through the chat template (on a worker thread: CPU-bound)."""
    text = render_chat(st.engine, msgs, field="input", tools=plan.tools if plan else ())
    return st.encode(text, add_special_tokens=False, field="input")


def _fitted_ids(st: ServerState, msgs: list[dict[str, Any]], plan: tl.ToolPlan | None,
                instructions: bool, max_tokens: int | None,
                request_id: str) -> tuple[list[int], int]:
    """``truncation: "auto"``: the input's ids with the oldest items dropped until it fits the
    context (:mod:`coda.server.responses_fit`; a cut is traced), and how many were dropped."""
    from coda.server.responses_fit import fit, trace_cut

    head = msgs[:1] if instructions else []
    fitted = fit(lambda m: _prompt_ids(st, [dict(x) for x in m], plan), head, msgs[len(head):],
                 max_tokens, st.engine.context_length)
    trace_cut(getattr(st.engine, "trace", None), request_id, fitted)
    return fitted.ids, fitted.dropped


def tool_plan(body: ResponsesRequest) -> tl.ToolPlan | None:
    """The request's tool plan; no tools nor tool choice is no plan, without entering the
    tool module (issue 22: what :func:`coda.server.tools.openai_plan` answers then)."""
    if not body.tools and body.tool_choice is None:
        return None
    plan = tl.openai_plan(body.tools, body.tool_choice, body.parallel_tool_calls, flat=True)
    limit = body.max_tool_calls
    if plan is None or limit is None:
        return plan
    if limit == 0:  # NOTE: no call allowed is tool_choice "none"; a required one cannot be
        if plan.mode in ("required", "named"):
            raise InvalidRequestError("max_tool_calls: 0 allows no call, but tool_choice "
                                      "requires one", field="max_tool_calls")
        return replace(plan, mode="none")
    return replace(plan, max_calls=limit)


def check_unhonoured(body: ResponsesRequest) -> None:
    """:func:`coda.server.fields.reject_unhonoured`, entered only where ``stream_options`` or
    ``background`` is set (issue 22: without them it refuses nothing)."""
    if body.stream_options is not None or body.background:
        reject_unhonoured(body)


def _echoed(body: ResponsesRequest) -> dict[str, object]:
    """The informational fields the response object repeats as sent (null where not sent),
    as OpenAI's does; ``reasoning`` as its two fields (no summary is generated)."""
    r = body.reasoning or {}
    return {"user": body.user, "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key, "top_logprobs": body.top_logprobs,
            "prompt_cache_retention": body.prompt_cache_retention,
            "max_tool_calls": body.max_tool_calls,
            "reasoning": {"effort": r.get("effort"), "summary": r.get("summary")}}


def check_results(body: ResponsesRequest, history: list[dict[str, Any]]) -> None:
    """Every call answered, every output answering a call (``check_responses_results``),
    entered only where the input has a tool item or a continued response has history (issue
    22: a text input answers no call; the previous response's calls stay unanswered)."""
    items = [] if isinstance(body.input, str) else body.input
    if history or any(isinstance(i, InputToolItem) for i in items):
        check_responses_results([i.model_dump() for i in items], history=history)


def reasoning_budget(st: ServerState, body: ResponsesRequest) -> int | None:
    """``max_reasoning_tokens``, or ``reasoning.effort`` mapped (:mod:`coda.server.fields`,
    entered only where the request has a ``reasoning`` object: issue 22)."""
    if body.reasoning is None:
        return body.max_reasoning_tokens
    return effort_budget(st.engine.tokenizer, responses_effort(body.reasoning),
                         body.max_reasoning_tokens)


class ResponsesAdapter:
    """Responses as a :class:`~coda.server.common.Adapter`; ``background`` keeps running
    without a client (P4)."""

    kind: Literal["response"] = "response"
    id_prefix = "resp_"
    id_header = "x-request-id"  # NOTE: as OpenAI's: the SDK's ``_request_id`` (the response id)

    async def parse(self, st: ServerState, body: ResponsesRequest) -> Record:
        st.check_model(body.model)
        plan = tool_plan(body)
        check_unhonoured(body)
        if body.metadata:  # NOTE: issue 22: a plain request never enters fields
            check_metadata(body.metadata)
        msgs = _messages(body)
        # NOTE: issue 24 item 3: any front end continues a stored response (Redis or memory)
        history, carried = await previous_history(st, body.previous_response_id) \
            if body.previous_response_id else ([], [])
        check_results(body, history)
        own = msgs[1:] if body.instructions else msgs
        msgs = [*msgs[:len(msgs) - len(own)], *history, *own]
        max_tokens = body.max_output_tokens  # NOTE: the wire's budget, under its one name
        call_id, dropped = new_id(self.id_prefix), 0
        if body.truncation == "auto":  # NOTE: issue 22: only then is responses_fit entered
            ids, dropped = await asyncio.to_thread(_fitted_ids, st, msgs, plan,
                                                   bool(body.instructions), max_tokens, call_id)
        else:
            ids = await asyncio.to_thread(_prompt_ids, st, msgs, plan)  # NOTE: CPU-bound
        fmt = body.text.format if body.text else None
        if fmt is not None and fmt.type == "json_object":
            check_json_word_responses(msgs)
        # NOTE: as OpenAI: logprobs only where ``include`` asks for them; ``top_logprobs``
        # alone sets how many alternatives they would carry, and returns none
        logprobs = ((body.top_logprobs or 0) if body.include
                    and "message.output_text.logprobs" in body.include else None)
        grammar = _grammar(fmt)
        tool = ((tl.knob_fields(plan, grammar, "text.format") if plan is not None else {})
                or {"grammar": grammar})
        reasoning = st.reasoning(ids, budget=reasoning_budget(st, body),
                                 budget_field="max_reasoning_tokens")
        spec = ResponsesRender(
            format=(fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                    else {"type": "text"}),
            verbosity=(body.text.verbosity if body.text and body.text.verbosity else "medium"),
            instructions=body.instructions, metadata=body.metadata or {},
            previous_response_id=body.previous_response_id, max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p, tools=bool(plan and plan.active),
            tools_echo=tuple(body.tools or ()),
            # NOTE: echoed as sent (a named tool_choice makes one call, and still says true)
            parallel=body.parallel_tool_calls is not False,
            tool_choice=body.tool_choice or "auto", store=body.store,
            logprobs=logprobs is not None, skip_special=body.skip_special_tokens,
            verify=body.stream_verify,
            thinking=reasoning is not None and body.include_reasoning,
            history=tuple([*history, *own]),
            # NOTE: listed only if stored (``store: false`` is never retrievable); kept as
            # sent, so a plain request builds no listing (issue 22: its walk stays the same)
            carried_items=tuple(carried), own_input=(
                () if not body.store else body.input if isinstance(body.input, str)
                else tuple(i.model_dump() for i in body.input)),
            service_tier=(served_tier(body.service_tier) if body.service_tier is not None
                          else None),
            echoed=_echoed(body), truncation=body.truncation or "disabled",
            dropped_items=dropped)
        return plan_call(body, [ids], spec, call_id=call_id,
                         kind=self.kind, model=st.engine.model_name,
                         backpressure=st.settings.backpressure, stream=body.stream,
                         on_disconnect=body.on_disconnect, background=body.background,
                         keep=body.store,
                         max_tokens=max_tokens, max_tokens_field="max_output_tokens",
                         prompt_field="input", stop=body.stop, seed=body.seed,
                         temperature=body.temperature, top_p=sampled_top_p(body.top_p),
                         presence_penalty=body.presence_penalty,
                         frequency_penalty=body.frequency_penalty, logprobs=logprobs,
                         logprobs_field="top_logprobs", reasoning=reasoning,
                         # NOTE: a grammar from text.format is named so, not response_format
                         grammar_field="text.format" if grammar is not None
                         else "response_format", **tool)

    def final(self, record: Record, terminals: list[Terminal] | None) -> Response:
        headers = {"x-request-id": record.id}
        if terminals is None:  # NOTE: background: answered at once, queued
            return JSONResponse(response_object(record, initial=True), headers=headers)
        if is_failed(terminals[0]):  # defect 4: status failed, an error status not retried
            return failed_json(response_object(record), terminals[0], headers=headers)
        return JSONResponse(response_object(record), headers=headers)


RESPONSES = ResponsesAdapter()
register_renderer(ResponsesRender, ResponsesRenderer)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    """Create a response; ``background`` keeps running without a client (P4)."""
    return await create(request, await RESPONSES.parse(state_of(request), body), RESPONSES)


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(body: ResponsesCountRequest, request: Request) -> Response:
    """OpenAI's input token count: the prompt ``POST /v1/responses`` would build from the
    same fields (checked as there: a bad one is the create's 400), counted; nothing is queued
    or stored."""
    st = state_of(request)
    sent = body.model_dump(exclude_none=True, by_alias=True)
    parsed = await RESPONSES.parse(st, ResponsesRequest.model_validate(
        {"model": st.engine.model_name, "input": [], **sent, "store": False}))
    ids = parsed.requests[0].prompt_token_ids
    grammar = parsed.requests[0].grammar
    try:  # NOTE: an input no create would take (over the context, a text.format schema the
        # grammar engine refuses: found at submit) is the create's 400
        check_prompt_room(len(ids), st.engine.context_length)
        if grammar is not None:
            from coda.engine.grammar import check_grammar  # NOTE: lazily, as the engine does

            check_grammar(grammar)
    except (ContextLengthExceededError, InvalidRequestError) as exc:
        raise api_error_from(exc, parsed.rename) from None
    return JSONResponse({"object": "response.input_tokens", "input_tokens": len(ids)})
