"""The Responses API's response object (issue 4 item 2; SPEC P1, P3): what ``POST
/v1/responses`` answers, ``GET /v1/responses/{id}`` retrieves and ``response.created`` /
``response.completed`` carry, built from the engine's event log alone, so every reader sees the
same object. Its output items: a ``reasoning`` item (issue 23), ``function_call`` items and the
``message`` item in the order the model wrote them (:func:`layout`). The event stream is
:mod:`coda.server.responses_stream`; the route :mod:`coda.server.responses_routes`.
"""

from __future__ import annotations

from typing import Any

from coda.reader import replay
from coda.server import logprobs as lp
from coda.server import tools as tl
from coda.server.common import partial_text
from coda.server.http_errors import error_message
from coda.server.mapping import coda_extension, responses_incomplete_reason, responses_status
from coda.server.records import Record
from coda.server.render_spec import ResponsesRender
from coda.stream import EventType, RequestStream


def item_id(record: Record) -> str:
    return "msg_" + record.id.removeprefix("resp_")


def reasoning_item(record: Record, text: str, status: str) -> dict[str, Any]:
    """Issue 23: the reasoning as an output item (its text in ``content``, no summary)."""
    return {"type": "reasoning", "id": "rs_" + record.id.removeprefix("resp_"),
            "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def response_object(record: Record, *, initial: bool = False) -> dict[str, Any]:
    """The response as it stands (``initial``: the snapshot of ``response.created``)."""
    stream: RequestStream = record.handles[0].stream
    spec = spec_of(record)
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
    # NOTE: P1, as OpenAI: a background response is "queued" until the engine works on it;
    # read from the log (every handle kind's, a replay's too, P3): its ``start`` event is
    # written at admission (GenerationRequest.start_at_admission), before the prefill
    if record.background and stream.last_seq < 0:
        return body  # NOTE: queued: nothing written yet, no output item (as created)
    body["status"] = "in_progress"
    # NOTE: P1, P3: exactly the items the stream announced so far (responses_stream): the
    # message item once an answer delta exists (or at the end), with tools what the parser
    # released (an open call, a held tag prefix, is no item yet)
    ended = terminal is not None
    if spec.tools:
        text, calls, at = layout(partial_text(stream), ended=ended)
    else:
        text, calls = partial_text(stream), []
        at = 0 if ended or _answered(stream) else None
    item_status = "in_progress"
    if terminal is not None:
        _, status = responses_status(terminal)
        body["status"] = status
        item_status = "completed" if status == "completed" else "incomplete"
        u = terminal.usage
        r_tokens = terminal.reasoning.reasoning_tokens if terminal.reasoning else 0
        body["usage"] = {"input_tokens": u.prompt_tokens,
                         # NOTE: P1: the SDK's InputTokensDetails requires both counts;
                         # Coda's prefix cache is automatic and bills no write (as Anthropic's
                         # cache_creation_input_tokens: 0)
                         "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens,
                                                  "cache_write_tokens": 0},
                         "output_tokens": u.selected_tokens,
                         "output_tokens_details": {"reasoning_tokens": r_tokens},
                         "total_tokens": u.prompt_tokens + u.selected_tokens}
        if status == "completed":
            # NOTE: P1: OpenAI's completion time, present only when completed; from the
            # terminal (not the clock), so a retrieve or a replay says the same (P3)
            body["completed_at"] = int(record.created + terminal.total_s)
        if status == "failed":
            body["error"] = {"code": "server_error", "message": error_message(terminal)}
        elif status == "incomplete":  # NOTE: a cancelled one has none, as OpenAI's
            body["incomplete_details"] = {
                "reason": responses_incomplete_reason(terminal.finish_reason)}
        body["coda"] = coda_extension(terminal)
        if spec.truncation == "auto":  # NOTE: how many oldest input items "auto" dropped
            body["coda"]["truncation"] = {"dropped_items": spec.dropped_items}
    reasoning = partial_text(stream, reasoning=True) if spec.thinking else ""
    cut = len(calls) if at is None else at
    body["output"] = [
        # NOTE: issue 23: a reasoning item exactly when reasoning deltas were rendered
        *([reasoning_item(record, reasoning, "completed" if text or terminal is not None
                           else "in_progress")] if reasoning else []),
        *(call_item(record, k, "completed") for k in calls[:cut]),
        *([message_item(record, text, item_status, _logprobs(record, stream))]
          if at is not None else []),
        *(call_item(record, k, "completed") for k in calls[cut:])]
    return body


def _answered(stream: RequestStream) -> bool:
    """Whether an answer delta (not reasoning) exists: the stream's message item opened."""
    return any(e.type is EventType.DELTA and not e.reasoning for e in replay(stream))


def layout(text: str, *, ended: bool = True) -> tuple[str, list[tl.ToolCall], int | None]:
    """An output with tools: its text outside calls, its calls, and the message item's place
    among the calls (how many calls the model wrote before its first text), or None when the
    output is calls alone: as OpenAI's, a function call is then ``output[0]``, with no empty
    message beside it. The stream opens its items in the same order. Not ``ended`` (in
    progress): only what the parser released so far, as the stream sent it; None also when
    nothing is out yet."""
    p = tl.ToolCallParser()
    items = p.feed(text) + (p.finish() if ended else [])
    calls = [i for i in items if isinstance(i, tl.ToolCall)]
    first = next((n for n, i in enumerate(items) if isinstance(i, str) and i), None)
    if first is None:
        return "", calls, None if calls or not ended else 0
    return tl.texts(items), calls, sum(isinstance(i, tl.ToolCall) for i in items[:first])


def spec_of(record: Record) -> ResponsesRender:
    spec = record.spec
    assert isinstance(spec, ResponsesRender)
    return spec


def call_item(record: Record, call: tl.ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{record.id.removeprefix('resp_')}_{call.index}",
            "call_id": call.call_id(record.id), "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def _logprobs(record: Record, stream: RequestStream) -> list[dict[str, Any]]:
    """Every returned token's logprobs so far (the final ``output_text`` carries them all,
    like the deltas did; trailing tokens as :func:`coda.server.logprobs.reported_trailing`)."""
    if not spec_of(record).logprobs:
        return []
    tokens = [t for e in replay(stream) if e.type is EventType.DELTA for t in e.tokens]
    terminal = stream.terminal
    if terminal is not None:
        tokens.extend(lp.reported_trailing(terminal))
    return lp.chat_entries(tokens, skip_special=spec_of(record).skip_special)


def message_item(record: Record, text: str, status: str,
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id(record), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": logprobs or []}]}
