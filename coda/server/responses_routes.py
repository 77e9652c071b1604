"""The OpenAI Responses API: ``POST /v1/responses`` (+ ``background``), ``GET
/v1/responses/{id}`` (+ ``stream=true&starting_after=N`` replay), ``POST
/v1/responses/{id}/cancel`` (issue 4 item 2; SPEC P1–P4, C1, L2–L5).

The event stream is a pure function of the engine's event log, so ``sequence_number`` (also
the SSE ``id``) is the same on every replay: ``response.created`` 0, ``response.in_progress``
1, ``output_item.added`` 2, ``content_part.added`` 3, one ``output_text.delta`` per engine
delta, then ``output_text.done``, ``content_part.done``, ``output_item.done`` and exactly one of
``response.completed | response.incomplete | response.failed`` last. A reasoning model's split
output (issue 23) opens with a ``reasoning`` item instead (output index 0: ``output_item.added``,
``reasoning_text.delta``…, ``reasoning_text.done``, ``output_item.done``), and the message item
follows at output index 1.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, Literal

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from coda.engine.types import GrammarSpec
from coda.errors import InvalidRequestError
from coda.finish import CancelCause
from coda.reader import replay, terminal_of
from coda.server import logprobs as lp
from coda.server import tools as tl
from coda.server.chat import render_chat
from coda.server.common import new_id, partial_text, state_of
from coda.server.create import create
from coda.server.failures import error_message, failed_json, is_failed
from coda.server.fields import (
    check_metadata,
    effort_budget,
    reject_unhonoured,
    responses_effort,
    served_tier,
)
from coda.server.http_errors import ApiError
from coda.server.integrity import resolve_resume
from coda.server.mapping import coda_extension, responses_incomplete_reason, responses_status
from coda.server.openai_checks import check_json_word_responses
from coda.server.params import Parsed, check_json_schema_format, plan_call, sampled_top_p
from coda.server.protocol_schemas import InputToolItem, ResponsesRequest, TextFormat
from coda.server.render_spec import ResponsesRender
from coda.server.responses_history import previous_history
from coda.server.sse import Frame, Renderer, SSEResponse
from coda.server.state import Record, ServerState, register_renderer
from coda.server.tool_messages import tool_history_item
from coda.server.tool_results import check_responses_results
from coda.stream import EventType, RequestStream, StreamEvent, Terminal

router = APIRouter()
_ROLES = frozenset({"system", "developer", "user", "assistant"})


def _item_id(record: Record) -> str:
    return "msg_" + record.id.removeprefix("resp_")


def _reasoning_item(record: Record, text: str, status: str) -> dict[str, Any]:
    """Issue 23: the reasoning as an output item (its text in ``content``, no summary)."""
    return {"type": "reasoning", "id": "rs_" + record.id.removeprefix("resp_"),
            "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def response_object(record: Record, *, initial: bool = False) -> dict[str, Any]:
    """The response as it stands (``initial``: the snapshot of ``response.created``)."""
    stream: RequestStream = record.handles[0].stream
    spec = _spec(record)
    terminal = None if initial else stream.terminal
    body: dict[str, Any] = {
        "id": record.id, "object": "response", "created_at": record.created,
        "model": record.model, "status": "queued" if record.background else "in_progress",
        "background": record.background, "error": None, "incomplete_details": None,
        "instructions": spec.instructions, "metadata": dict(spec.metadata),
        "previous_response_id": spec.previous_response_id,
        "max_output_tokens": spec.max_tokens, "output": [],
        # NOTE: the values sampled with, as OpenAI echoes them: 1.0 when not sent (P1), and
        # parallel_tool_calls as sent (default true) with tools or without
        "parallel_tool_calls": spec.parallel,
        "temperature": 1.0 if spec.temperature is None else spec.temperature,
        "top_p": 1.0 if spec.top_p is None else spec.top_p,
        # NOTE: P1: the tools and tool_choice as sent, also where no call can be made
        # (tool_choice "none"), as OpenAI echoes them
        "tool_choice": spec.tool_choice, "tools": list(spec.tools_echo),
        "text": {"format": dict(spec.format), "verbosity": spec.verbosity}, "truncation": spec.truncation, "usage": None,
        "store": spec.store,
        **({"service_tier": spec.service_tier} if spec.service_tier else {}),
        **spec.echoed,
    }
    if initial:
        return body
    body["status"] = "in_progress"
    text, calls, at = _layout(partial_text(stream)) if spec.tools else (partial_text(stream), [], 0)
    item_status = "in_progress"
    if terminal is not None:
        _, status = responses_status(terminal)
        body["status"] = status
        item_status = "completed" if status == "completed" else "incomplete"
        u = terminal.usage
        r_tokens = terminal.reasoning.reasoning_tokens if terminal.reasoning else 0
        body["usage"] = {"input_tokens": u.prompt_tokens,
                         "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
                         "output_tokens": u.selected_tokens,
                         "output_tokens_details": {"reasoning_tokens": r_tokens},
                         "total_tokens": u.prompt_tokens + u.selected_tokens}
        if status == "completed":
            # NOTE: P1: OpenAI's completion time, present only when completed; from the
            # terminal (not the clock), so a retrieve or a replay says the same (P3)
            body["completed_at"] = int(record.created + terminal.timings.total_s)
        if status == "failed":
            body["error"] = {"code": "server_error", "message": error_message(terminal)}
        elif status != "completed":
            body["incomplete_details"] = {
                "reason": responses_incomplete_reason(terminal.finish_reason)}
        body["coda"] = coda_extension(terminal)
        if spec.truncation == "auto":  # NOTE: how many oldest input items "auto" dropped
            body["coda"]["truncation"] = {"dropped_items": spec.dropped_items}
    reasoning = partial_text(stream, reasoning=True) if spec.thinking else ""
    cut = len(calls) if at is None else at
    body["output"] = [
        # NOTE: issue 23: a reasoning item exactly when reasoning deltas were rendered
        *([_reasoning_item(record, reasoning, "completed" if text or terminal is not None
                           else "in_progress")] if reasoning else []),
        *(_call_item(record, k, "completed") for k in calls[:cut]),
        *([_message_item(record, text, item_status, _logprobs(record, stream))]
          if at is not None else []),
        *(_call_item(record, k, "completed") for k in calls[cut:])]
    return body


def _layout(text: str) -> tuple[str, list[tl.ToolCall], int | None]:
    """An output with tools: its text outside calls, its calls, and the message item's place
    among the calls (how many calls the model wrote before its first text), or None when the
    output is calls alone: as OpenAI's, a function call is then ``output[0]``, with no empty
    message beside it. The stream opens its items in the same order."""
    p = tl.ToolCallParser()
    items = p.feed(text) + p.finish()
    calls = [i for i in items if isinstance(i, tl.ToolCall)]
    first = next((n for n, i in enumerate(items) if isinstance(i, str) and i), None)
    if first is None:
        return "", calls, None if calls else 0
    return tl.texts(items), calls, sum(isinstance(i, tl.ToolCall) for i in items[:first])


def _spec(record: Record) -> ResponsesRender:
    spec = record.spec
    assert isinstance(spec, ResponsesRender)
    return spec


def _is_delta(obj: dict[str, Any]) -> bool:
    return obj.get("type") in ("response.output_text.delta",
                               "response.function_call_arguments.delta")


def _call_item(record: Record, call: tl.ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{record.id.removeprefix('resp_')}_{call.index}",
            "call_id": call.call_id(record.id), "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def _logprobs(record: Record, stream: RequestStream) -> list[dict[str, Any]]:
    """Every returned token's logprobs so far (the final ``output_text`` carries them all,
    like the deltas did; trailing tokens as :func:`coda.server.logprobs.reported_trailing`)."""
    if not _spec(record).logprobs:
        return []
    tokens = [t for e in replay(stream) if e.type is EventType.DELTA for t in e.tokens]
    terminal = stream.terminal
    if terminal is not None:
        tokens.extend(lp.reported_trailing(terminal))
    return lp.chat_entries(tokens, skip_special=_spec(record).skip_special)


def _message_item(record: Record, text: str, status: str,
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": _item_id(record), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": logprobs or []}]}


class ResponsesRenderer(Renderer):
    """Deterministic Responses events; frames numbered ``<= starting_after`` are skipped."""

    position_ids = False  # NOTE: every frame carries its own sequence number

    def __init__(self, record: Record, after: list[int] | None) -> None:
        super().__init__(1, [-1])  # NOTE: always regenerate from the start (deterministic)
        spec = _spec(record)
        self.r, self.logprobs, self.skip_special = record, spec.logprobs, spec.skip_special
        # NOTE: ``after`` holds the last Responses sequence number the client has
        self.skip, self.seq, self.text = -1 if after is None else after[0], 0, ""
        self.parser = tl.ToolCallParser() if spec.tools else None
        if spec.verify:
            self.enable_verify(record.streams)
        # NOTE: issue 23: the message item opens lazily after a reasoning item, if any
        self.show_reasoning = spec.thinking
        self.reasoning: str | None = None   # the reasoning item's text once it opened
        self.message_open = False
        self.message_at = 0  # NOTE: the message item's output_index once it opened
        self.calls = 0  # function_call items opened so far

    def _emit(self, obj: dict[str, Any]) -> list[Frame]:
        seq = self.seq
        self.seq += 1
        if seq <= self.skip:
            return []
        return [Frame({"type": obj["type"], "sequence_number": seq, **obj},
                      event=obj["type"], id=str(seq))]

    def header(self) -> list[Frame]:
        snap = response_object(self.r, initial=True)
        return (self._emit({"type": "response.created", "response": snap})
                + self._emit({"type": "response.in_progress",
                              "response": {**snap, "status": "in_progress"}}))

    def _close_reasoning(self) -> list[dict[str, Any]]:
        """The reasoning item's end (once, before the first item after it)."""
        if self.reasoning is None or self.message_open or self.calls:
            return []
        rid = "rs_" + self.r.id.removeprefix("resp_")
        return [{"type": "response.reasoning_text.done", "item_id": rid, "output_index": 0,
                 "content_index": 0, "text": self.reasoning},
                {"type": "response.output_item.done", "output_index": 0,
                 "item": _reasoning_item(self.r, self.reasoning, "completed")}]

    def _message_opening(self) -> list[dict[str, Any]]:
        """Close the reasoning item (if open) and open the message item (once), after the
        items already opened."""
        if self.message_open:
            return []
        out = self._close_reasoning()
        self.message_open = True
        self.message_at = int(self.reasoning is not None) + self.calls
        ids = self._ids()
        return out + [{"type": "response.output_item.added", "output_index": self.message_at,
                       "item": _message_item(self.r, "", "in_progress")},
                      {"type": "response.content_part.added", **ids,
                       "part": {"type": "output_text", "text": "", "annotations": [],
                                "logprobs": []}}]

    def _open_message(self) -> list[Frame]:
        return [f for obj in self._message_opening() for f in self._emit(obj)]

    def _ids(self) -> dict[str, Any]:
        return {"item_id": _item_id(self.r), "output_index": self.message_at, "content_index": 0}

    def _reasoning_delta(self, index: int, ev: StreamEvent) -> list[Frame]:
        """Issue 23: a reasoning delta: the reasoning item opens at the first."""
        if not self.show_reasoning or self.message_open or self.calls:
            return []
        out: list[Frame] = []
        rid = "rs_" + self.r.id.removeprefix("resp_")
        if self.reasoning is None:
            self.reasoning = ""
            out += self._emit({"type": "response.output_item.added", "output_index": 0,
                               "item": _reasoning_item(self.r, "", "in_progress")})
        self.reasoning += ev.text
        return out + self._emit({"type": "response.reasoning_text.delta", "item_id": rid,
                                 "output_index": 0, "content_index": 0, "delta": ev.text,
                                 **self.stamp(index, ev)})

    def on_event(self, index: int, ev: StreamEvent, positions: list[int]) -> list[Frame]:
        if ev.type is EventType.START:
            # NOTE: a split output (issue 23) may start with a reasoning item instead
            # and with tools the message item opens at the first text (_layout)
            return [] if self.show_reasoning or self.parser is not None else self._open_message()
        if ev.type is EventType.DELTA and ev.reasoning:
            return self._reasoning_delta(index, ev)
        if ev.type is EventType.DELTA and self.parser is not None:
            # NOTE: with tools the message item opens at the first text: calls alone have none
            entries = lp.chat_entries(ev.tokens, skip_special=self.skip_special) if self.logprobs else []
            self.take(index, ev)  # NOTE: issue 20 D5: the next delta event's stamp covers it
            return self._emit_all(index, self._tool_events(self.parser.feed(ev.text), entries))
        opened = [] if self.parser is not None else self._open_message()
        ids = self._ids()
        if ev.type is EventType.DELTA:
            entries = lp.chat_entries(ev.tokens, skip_special=self.skip_special) if self.logprobs else []
            self.text += ev.text
            return opened + self._emit({"type": "response.output_text.delta", **ids,
                                        "delta": ev.text, "logprobs": entries,
                                        **self.stamp(index, ev)})
        assert ev.terminal is not None
        pre: list[Frame] = []
        if self.parser is not None:
            pre = self._emit_all(index, self._tool_events(self.parser.finish(), []))
            if not self.message_open and not self.calls:
                pre += self._open_message()  # NOTE: no text and no call: one empty message
        final = response_object(self.r)
        kind, _ = responses_status(ev.terminal)
        if not self.message_open:
            # NOTE: calls alone: no message item to close
            pre += [f for obj in self._close_reasoning() for f in self._emit(obj)]
            end = {"type": kind, "response": final}
            self.stamp_last(index, [end])  # NOTE: bytes no delta event carried, if any
            return pre + self._emit(end)
        ids = self._ids()
        item = final["output"][ids["output_index"]]
        done = {"type": "response.output_text.done", **ids, "text": self.text,
                "logprobs": item["content"][0]["logprobs"]}
        self.stamp_last(index, [done])  # NOTE: bytes no delta event carried (tools), if any
        return (opened + pre + self._emit(done)
                + self._emit({"type": "response.content_part.done", **ids,
                              "part": item["content"][0]})
                + self._emit({"type": "response.output_item.done",
                              "output_index": ids["output_index"], "item": item})
                + self._emit({"type": kind, "response": final}))


    def _emit_all(self, index: int, objs: list[dict[str, Any]]) -> list[Frame]:
        """Emit ``objs``, the last delta event stamped (issue 20 D5) even when replay skips it, so a
        resumed stream's stamps are the first delivery's."""
        self.stamp_last(index, objs, _is_delta)
        return [f for obj in objs for f in self._emit(obj)]

    def _tool_events(self, items: list[tl.Item], entries: list[Any]) -> list[dict[str, Any]]:
        """Text deltas of the message item (opened at the first text), and one function_call
        output item per call (added, the whole arguments as one delta, done), each item after
        those already opened (the order of :func:`_layout`)."""
        out: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, str):
                if item:
                    out += self._message_opening()
                    self.text += item
                    out.append({"type": "response.output_text.delta", **self._ids(),
                                "delta": item, "logprobs": entries})
                continue
            out += self._close_reasoning()
            at = {"output_index": int(self.reasoning is not None) + self.calls
                  + int(self.message_open)}
            self.calls += 1
            added = _call_item(self.r, item, "in_progress")
            done = _call_item(self.r, item, "completed")
            out += [{"type": "response.output_item.added", **at, "item": added},
                    {"type": "response.function_call_arguments.delta", **at,
                     "item_id": added["id"], "delta": item.arguments},
                    {"type": "response.function_call_arguments.done", **at,
                     "item_id": added["id"], "arguments": item.arguments},
                    {"type": "response.output_item.done", **at, "item": done}]
        return out


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


def stored_record(request: Request, rid: str) -> Record:
    """The stored response ``rid``; unknown, unstored or deleted: a 404."""
    record = state_of(request).store.get(rid)
    if record is None or not isinstance(record.spec, ResponsesRender) or not record.spec.store:
        raise ApiError(404, f"No response found with id '{rid}'", param="response_id",
                       code="not_found")
    return record


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


def reasoning_budget(st: ServerState, body: ResponsesRequest, grammar: bool) -> int | None:
    """``max_reasoning_tokens``, or ``reasoning.effort`` mapped (:mod:`coda.server.fields`,
    entered only where the request has a ``reasoning`` object: issue 22)."""
    if body.reasoning is None:
        return body.max_reasoning_tokens
    return effort_budget(st.engine.tokenizer, responses_effort(body.reasoning),
                         body.max_reasoning_tokens, grammar=grammar)


class ResponsesAdapter:
    """Responses as a :class:`~coda.server.create.Adapter`; ``background`` keeps running
    without a client (P4)."""

    kind: Literal["response"] = "response"
    id_prefix = "resp_"
    id_header = "x-request-id"  # NOTE: as OpenAI's: the SDK's ``_request_id`` (the response id)

    async def parse(self, st: ServerState, body: ResponsesRequest) -> Parsed:
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
        logprobs = body.top_logprobs if body.top_logprobs is not None else (
            0 if body.include and "message.output_text.logprobs" in body.include else None)
        grammar = _grammar(fmt)
        tool = ((tl.knob_fields(plan, grammar, "text.format") if plan is not None else {})
                or {"grammar": grammar})
        reasoning = st.reasoning(ids, budget=reasoning_budget(st, body, tool["grammar"] is not None),
                                 budget_field="max_reasoning_tokens",
                                 grammar=tool["grammar"] is not None)
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


def _last_event_through(record: Record, seq: int) -> int:
    """The number of the last Responses event rendered for the engine events up to ``seq``.
    NOTE: replayed, not counted: with tools a delta yields zero or several events (issue 20
    D5); without, this is ``seq + 3`` (created, in_progress, output_item.added,
    content_part.added, then one event per delta)."""
    r = record.make_renderer([1 << 62])  # NOTE: skips every frame; only numbers them
    assert isinstance(r, ResponsesRenderer)
    r.header()
    for ev in replay(record.streams[0]):
        if ev.seq > seq:
            break
        r.on_event(0, ev, [ev.seq])
    return r.seq - 1


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, stream: bool = False,
                       starting_after: int | None = None, offset: str | None = None,
                       digest: str | None = None) -> Response:
    """The stored response; with ``stream=true`` its event stream replayed after
    ``starting_after`` (or ``Last-Event-ID``), then followed live (P3). ``offset`` (and
    ``digest``) name the output bytes the client holds; a mismatch is a 409."""
    record = stored_record(request, response_id)
    if not stream:
        return JSONResponse(response_object(record))
    st = state_of(request)
    after = starting_after
    if after is None:
        header = request.headers.get("last-event-id", "").strip()
        after = int(header) if header.lstrip("-").isdigit() else None
    if offset is not None or digest is not None:
        resolved = resolve_resume(record.streams, None, offset, digest)
        assert resolved is not None
        held = _last_event_through(record, resolved[0])
        if after is not None and after != held:
            raise ApiError(409, f"offset {offset} is event {held}, not starting_after {after}",
                           param="offset", code="resume_mismatch")
        after = held
    after = -1 if after is None else after
    if after < -1:
        raise ApiError(400, "starting_after must be >= -1", param="starting_after")
    # NOTE: a replaying reader never cancels: the original request owns the P4 policy.
    return SSEResponse(record.streams, record.make_renderer([after]),
                       keepalive_s=st.settings.keepalive_s,
                       write_timeout_s=st.settings.write_timeout_s)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    """Cancel (C1); idempotent — a finished response is returned unchanged."""
    record = stored_record(request, response_id)
    record.cancel(CancelCause.CLIENT)
    await asyncio.gather(*(terminal_of(h.stream) for h in record.handles))
    return JSONResponse(response_object(record))
