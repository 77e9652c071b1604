"""``POST /v1/messages``: the Anthropic Messages API (issue 4 item 2; SPEC P1–P4, L4–L6).

Stream: ``message_start``, ``content_block_start``, ``ping`` (on the engine's start event),
``content_block_delta`` per delta, then ``content_block_stop``, ``message_delta`` (``stop_reason``
``end_turn`` | ``max_tokens`` | ``stop_sequence`` with the matched ``stop_sequence``, and the
exact outcome in ``coda``) and ``message_stop`` — or one in-band ``error`` event when the model
failed. A final assistant message is a prefill the model continues.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from coda.errors import InvalidRequestError
from coda.server.chat import content_text, render_chat
from coda.server.common import collect, new_id, now, state_of, stream_or_wait
from coda.server.http_errors import ApiError
from coda.server.mapping import anthropic_stop_reason, coda_extension, is_model_failure
from coda.server.params import Knobs, build_requests, encode, rename_map
from coda.server.protocol_schemas import AnthropicRequest
from coda.server.sse import Frame, Renderer, position_id
from coda.server.state import Record
from coda.stream import EventType, StreamEvent, Terminal

router = APIRouter()
_ROLES = frozenset({"user", "assistant"})


def _stop_fields(terminal: Terminal) -> tuple[str, str | None]:
    reason = anthropic_stop_reason(terminal.finish_reason)
    stop = terminal.stop.stop if terminal.stop is not None else None
    return reason, stop if isinstance(stop, str) else None


def _usage(terminal: Terminal | None, input_tokens: int) -> dict[str, int]:
    if terminal is None:
        return {"input_tokens": input_tokens, "output_tokens": 0}
    u = terminal.usage
    return {"input_tokens": u.prompt_tokens - u.cached_prompt_tokens,
            "cache_read_input_tokens": u.cached_prompt_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": u.selected_tokens}


class AnthropicRenderer(Renderer):
    def __init__(self, record: Record, after: list[int] | None) -> None:
        super().__init__(1, after)
        self.r = record
        if record.extra.get("verify"):
            self.enable_verify(record.streams)

    def _frame(self, kind: str, fid: str, **data: Any) -> Frame:
        return Frame({"type": kind, **data}, event=kind, id=fid)

    def on_event(self, index: int, ev: StreamEvent, positions: list[int]) -> list[Frame]:
        fid = position_id(positions)
        if ev.type is EventType.START:
            message = {"id": self.r.id, "type": "message", "role": "assistant",
                       "model": self.r.model, "content": [], "stop_reason": None,
                       "stop_sequence": None,
                       "usage": _usage(None, self.r.extra["input_tokens"])}
            return [self._frame("message_start", fid, message=message),
                    self._frame("content_block_start", fid, index=0,
                                content_block={"type": "text", "text": ""}),
                    self._frame("ping", fid)]
        if ev.type is EventType.DELTA:
            return [self._frame("content_block_delta", fid, index=0,
                                delta={"type": "text_delta", "text": ev.text},
                                **self.stamp(index, ev))]
        terminal = ev.terminal
        assert terminal is not None
        ext = coda_extension(
            terminal, self.r.delivery.network_send_s(index, self.network_send_s))
        if is_model_failure(terminal):
            # NOTE: Anthropic's in-band error event; it is this stream's final event.
            return [self._frame("error", fid, error={
                "type": "api_error", "message": terminal.error_message or "model error"},
                coda=ext)]
        reason, stop = _stop_fields(terminal)
        return [self._frame("content_block_stop", fid, index=0),
                self._frame("message_delta", fid,
                            delta={"stop_reason": reason, "stop_sequence": stop},
                            usage=_usage(terminal, self.r.extra["input_tokens"]), coda=ext),
                self._frame("message_stop", fid)]


def _messages(body: AnthropicRequest) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if body.system:
        msgs.append({"role": "system", "content": content_text(body.system, "system")})
    for i, m in enumerate(body.messages):
        if m.role not in _ROLES:
            raise InvalidRequestError(
                f"messages.{i}.role: must be 'user' or 'assistant', got {m.role!r}",
                field=f"messages.{i}.role")
        msgs.append({"role": m.role, "content": content_text(m.content, f"messages.{i}")})
    return msgs


@router.post("/v1/messages")
async def create_message(body: AnthropicRequest, request: Request) -> Response:
    """Anthropic Messages (streaming and not) with the Coda extensions."""
    st = state_of(request)
    st.check_model(body.model)
    if body.tools:
        raise InvalidRequestError("tools: tool use is not supported", field="tools")
    if body.thinking and body.thinking.get("type") not in (None, "disabled"):
        raise InvalidRequestError("thinking: extended thinking is not supported",
                                  field="thinking")
    msgs = _messages(body)
    prefill = msgs[-1]["role"] == "assistant"
    text = render_chat(st.engine, msgs, continue_final_message=prefill)
    ids = encode(st.engine, text, add_special_tokens=False)
    knobs = Knobs(max_tokens=body.max_tokens, max_tokens_field="max_tokens",
                  prompt_field="messages", stop=body.stop_sequences, stop_field="stop_sequences",
                  seed=body.seed, temperature=body.temperature, top_p=body.top_p)
    rid = new_id("msg_")
    reqs = build_requests(body, knobs, ids, request_id=rid,
                          default_max_tokens=st.engine_config.default_max_tokens,
                          context_length=st.engine.context_length,
                          backpressure=st.settings.backpressure)
    handles = st.submit_all(reqs, rename_map(knobs))
    record = Record(rid, "anthropic", handles, now(), st.engine.model_name,
                    make_renderer=lambda after: AnthropicRenderer(record, after),
                    extra={"input_tokens": len(ids), "verify": body.stream_verify})
    st.store.put(record)
    done = await stream_or_wait(request, st, record, stream=body.stream,
                                policy=body.on_disconnect or st.settings.on_disconnect,
                                headers={"request-id": rid})
    if isinstance(done, Response):
        return done
    c = collect(handles[0].stream)
    if is_model_failure(c.terminal):
        raise ApiError(500, c.terminal.error_message or "model error")
    reason, stop = _stop_fields(c.terminal)
    return JSONResponse({"id": rid, "type": "message", "role": "assistant",
                         "model": record.model, "content": [{"type": "text", "text": c.text}],
                         "stop_reason": reason, "stop_sequence": stop,
                         "usage": _usage(c.terminal, len(ids)),
                         "coda": coda_extension(c.terminal)}, headers={"request-id": rid})
