"""``POST /v1/messages``: the Anthropic Messages API (issue 4 item 2; SPEC P1–P4, L4–L6).

Stream: ``message_start``, ``content_block_start``, ``ping`` (with the engine's first event
after start, so the usage states the prefix-cache lookup's result: issue 20 D9),
``content_block_delta`` per delta, then ``content_block_stop``, ``message_delta`` (``stop_reason``
``end_turn`` | ``max_tokens`` | ``stop_sequence`` with the matched ``stop_sequence``, and the
exact outcome in ``coda``) and ``message_stop`` — or one in-band ``error`` event when the model
failed. A final assistant message is a prefill the model continues. A reasoning model's split
output (issue 23) opens its blocks lazily: a ``thinking`` block (``thinking_delta``s, an empty
``signature_delta``), then the text block.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from coda.errors import InvalidRequestError
from coda.reader import replay
from coda.server import tools as tl
from coda.server.anthropic_checks import (
    check_system_blocks,
    check_thinking_blocks,
    thinking_budget,
)
from coda.server.anthropic_request import (
    check_pairs,
    check_server_tools,
    merge_turns,
    output_grammar,
)
from coda.server.chat import content_text, render_chat
from coda.server.common import collect, new_id, state_of
from coda.server.create import create
from coda.server.failures import anthropic_error, failed_json, is_failed
from coda.server.mapping import anthropic_stop_reason, coda_extension
from coda.server.params import Parsed, plan_call
from coda.server.protocol_schemas import AnthropicCountRequest, AnthropicMessage, AnthropicRequest
from coda.server.render_spec import AnthropicRender
from coda.server.sse import Frame, Renderer, position_id
from coda.server.state import Record, ServerState, register_renderer
from coda.server.tool_messages import anthropic_history
from coda.stream import EventType, StreamEvent, Terminal

router = APIRouter()
_ROLES = frozenset({"user", "assistant"})


def _stop_fields(terminal: Terminal, calls: int = 0) -> tuple[str, str | None]:
    reason = anthropic_stop_reason(terminal.finish_reason)
    if calls and reason == "end_turn":
        reason = "tool_use"
    stop = terminal.stop.stop if terminal.stop is not None else None
    return reason, stop if isinstance(stop, str) else None


def _tool_use(call: tl.ToolCall, rid: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.call_id(rid).removeprefix("call_"),
            "name": call.name, "input": json.loads(call.arguments)}


def _tier(spec: AnthropicRender) -> dict[str, str]:
    """``usage.service_tier``, when the request named one: the one local tier, "standard"."""
    return {"service_tier": spec.service_tier} if spec.service_tier else {}


def _usage(terminal: Terminal | None, input_tokens: int, cached: int = 0) -> dict[str, int]:
    if terminal is None:  # NOTE: message_start: after the prefix-cache lookup (issue 20 D9)
        return {"input_tokens": input_tokens - cached, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": 0}
    u = terminal.usage
    return {"input_tokens": u.prompt_tokens - u.cached_prompt_tokens,
            "cache_read_input_tokens": u.cached_prompt_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": u.selected_tokens}


class AnthropicRenderer(Renderer):
    def __init__(self, record: Record, after: list[int] | None) -> None:
        super().__init__(1, after)
        spec = record.spec
        assert isinstance(spec, AnthropicRender)
        self.r, self.input_tokens = record, spec.input_tokens
        self.tier = _tier(spec)
        # NOTE: with tools, blocks open lazily: text (index k) or tool_use, one at a time
        self.parser: tl.ToolCallParser | None = None
        self.block = -1          # index of the last block started
        self.text_open = False
        # NOTE: issue 23: a split output opens its blocks lazily: thinking, then text
        self.thinking = spec.thinking
        self.show_reasoning = spec.reasoning
        self.thinking_open = False
        if self.thinking:
            for e in replay(record.handles[0].stream):
                if e.type is EventType.DELTA and e.seq <= self.after[0]:
                    self._split_blocks(e, "")  # NOTE: replays the block state (resume)
        unstamped = 0  # NOTE: bytes before the resume point that no stamped frame covered
        if spec.tools:
            stream = record.handles[0].stream
            self.parser = tl.ToolCallParser()
            for e in replay(stream):
                if e.type is EventType.DELTA and e.seq <= self.after[0]:
                    # NOTE: replays the block state
                    out = self._blocks(self.parser.feed(e.text), "")
                    stamped = any(_is_block_delta(f.data) for f in out)
                    unstamped = 0 if stamped else unstamped + len(e.data)
        if spec.verify:
            self.enable_verify(record.streams)
            if self.verify is not None and unstamped:
                self.verify.unstamp(0, unstamped)

    def _frame(self, kind: str, fid: str, **data: Any) -> Frame:
        return Frame({"type": kind, **data}, event=kind, id=fid)

    def on_event(self, index: int, ev: StreamEvent, positions: list[int]) -> list[Frame]:
        fid = position_id(positions)
        if ev.type is EventType.START:
            return []  # NOTE: issue 20 D9: message_start waits for the prefix-cache lookup's result
        if ev.seq == 1:  # NOTE: the first event after start: a replay past it never repeats it
            return [*self._start(ev, fid), *self._on_event(index, ev, fid)]
        return self._on_event(index, ev, fid)

    def _start(self, ev: StreamEvent, fid: str) -> list[Frame]:
        """``message_start`` with the final input usage (issue 20 D9): the first delta or the
        terminal comes after the prefix-cache lookup and states how many prompt tokens it
        held (``input_tokens`` + ``cache_read_input_tokens`` = the prompt)."""
        prompt = self.input_tokens
        if ev.terminal is not None:
            usage = {**_usage(ev.terminal, prompt), "output_tokens": 0}
        else:
            usage = _usage(None, prompt, ev.cached_prompt_tokens or 0)
        message: dict[str, Any] = {
            "id": self.r.id, "type": "message", "role": "assistant", "model": self.r.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {**usage, **self.tier}}
        if self.parser is not None or self.thinking:
            return [self._frame("message_start", fid, message=message), self._frame("ping", fid)]
        return [self._frame("message_start", fid, message=message),
                self._frame("content_block_start", fid, index=0,
                            content_block={"type": "text", "text": ""}),
                self._frame("ping", fid)]

    def _split_blocks(self, ev: StreamEvent, fid: str) -> list[Frame]:
        """Issue 23: a delta of a split output: a reasoning delta goes to the thinking block
        (opened at the first), an answer delta to the text block (the thinking block, if open,
        is closed first). The signature is empty: Coda signs nothing (docs/api.md)."""
        out: list[Frame] = []
        if ev.reasoning:
            if not self.show_reasoning:
                return out
            if not self.thinking_open:
                self.block += 1
                self.thinking_open = True
                out.append(self._frame("content_block_start", fid, index=self.block,
                                       content_block={"type": "thinking", "thinking": "",
                                                      "signature": ""}))
            out.append(self._frame("content_block_delta", fid, index=self.block,
                                   delta={"type": "thinking_delta", "thinking": ev.text},
                                   **self.stamp(0, ev)))
            return out
        out += self._close_thinking(fid)
        return out + self._text(fid, ev.text, **self.stamp(0, ev))

    def _text(self, fid: str, text: str, **extra: Any) -> list[Frame]:
        """A text delta, opening the text block first where none is open."""
        out: list[Frame] = []
        if not self.text_open:
            self.block += 1
            self.text_open = True
            out.append(self._frame("content_block_start", fid, index=self.block,
                                   content_block={"type": "text", "text": ""}))
        out.append(self._frame("content_block_delta", fid, index=self.block,
                               delta={"type": "text_delta", "text": text}, **extra))
        return out

    def _close_thinking(self, fid: str) -> list[Frame]:
        if not self.thinking_open:
            return []
        self.thinking_open = False
        return [self._frame("content_block_delta", fid, index=self.block,
                            delta={"type": "signature_delta", "signature": ""}),
                self._frame("content_block_stop", fid, index=self.block)]

    def _on_event(self, index: int, ev: StreamEvent, fid: str) -> list[Frame]:
        if ev.type is EventType.DELTA:
            if self.thinking:
                return self._split_blocks(ev, fid)
            if ev.reasoning:
                return []  # NOTE: issue 23: reasoning dropped (thinking disabled)
            if self.parser is not None:
                self.take(index, ev)  # NOTE: issue 20 D5: the next block delta's stamp covers it
                out = self._blocks(self.parser.feed(ev.text), fid)
                self.stamp_last(index, [f.data for f in out], _is_block_delta)
                return out
            return [self._frame("content_block_delta", fid, index=0,
                                delta={"type": "text_delta", "text": ev.text},
                                **self.stamp(index, ev))]
        terminal = ev.terminal
        assert terminal is not None
        ext = coda_extension(
            terminal, self.r.network_send_s(index, self.network_send_s))
        frames: list[Frame] = []
        calls = 0
        if self.parser is not None:
            frames = self._blocks(self.parser.finish(), fid)
            self.stamp_last(index, [f.data for f in frames], _is_block_delta)
            self.stamp_into(index, ext)  # NOTE: bytes no block delta carried (issue 20 D5), if any
            calls = self.parser.calls
            ext["tool_calls"] = {"count": calls, "removed_bytes": self.parser.removed_bytes}
        if is_failed(terminal):
            # NOTE: Anthropic's in-band error event; it is this stream's final event.
            return [self._frame("error", fid, error=anthropic_error(terminal), coda=ext)]
        reason, stop = _stop_fields(terminal, calls)
        if self.thinking:
            frames += self._close_thinking(fid)
            if not self.text_open:  # NOTE: the answer is empty: still one text block
                self.block += 1
                frames.append(self._frame("content_block_start", fid, index=self.block,
                                          content_block={"type": "text", "text": ""}))
            frames.append(self._frame("content_block_stop", fid, index=self.block))
        elif self.parser is None:
            frames.append(self._frame("content_block_stop", fid, index=0))
        elif self.text_open:
            frames.append(self._frame("content_block_stop", fid, index=self.block))
        return [*frames,
                self._frame("message_delta", fid,
                            delta={"stop_reason": reason, "stop_sequence": stop},
                            usage={**_usage(terminal, self.input_tokens), **self.tier},
                            coda=ext),
                self._frame("message_stop", fid)]


    def _blocks(self, items: list[tl.Item], fid: str) -> list[Frame]:
        """Frames of text and complete calls (a tool_use block each: start, one
        ``input_json_delta`` with the whole arguments, stop)."""
        out: list[Frame] = []
        for item in items:
            if isinstance(item, str):
                if item:
                    out += self._text(fid, item)
                continue
            if self.text_open:
                out.append(self._frame("content_block_stop", fid, index=self.block))
                self.text_open = False
            self.block += 1
            block = {**_tool_use(item, self.r.id), "input": {}}
            out += [self._frame("content_block_start", fid, index=self.block,
                                content_block=block),
                    self._frame("content_block_delta", fid, index=self.block,
                                delta={"type": "input_json_delta",
                                       "partial_json": item.arguments}),
                    self._frame("content_block_stop", fid, index=self.block)]
        return out


def _is_block_delta(obj: dict[str, Any]) -> bool:
    return obj.get("type") == "content_block_delta"


def _thinking(body: AnthropicRequest) -> tuple[bool, int | None]:
    """Issue 23: ``thinking`` → (show the reasoning, its budget). Absent: shown, no budget
    (the model reasons anyway); ``disabled``: dropped; ``enabled``: shown, ``budget_tokens``
    (Coda's ``max_reasoning_tokens`` too, for one spelling across protocols)."""
    # NOTE: issue 22: without ``thinking`` there is nothing to check: (None, Coda's budget)
    kind, budget = (thinking_budget(body.thinking, body.max_reasoning_tokens, body.max_tokens)
                    if body.thinking is not None else (None, body.max_reasoning_tokens))
    return kind != "disabled" and body.include_reasoning, budget


def chat_messages(body: AnthropicRequest | AnthropicCountRequest) -> list[dict[str, Any]]:
    """The request's system prompt and messages as chat messages (roles checked, every
    ``tool_result`` answering a ``tool_use`` of the message before it)."""
    ms = body.messages
    # NOTE: as Anthropic: consecutive messages of one role are one turn (anthropic_request);
    # issue 22: an alternating conversation has none to merge and never enters that module
    turns = (merge_turns(ms) if any(x.role == y.role for x, y in zip(ms, ms[1:], strict=False))
             else None)
    # NOTE: issue 22: a string content holds no block (no tool_use, no tool_result): the
    # tool modules are entered only for block contents, where they have something to do
    if not all(isinstance(m.content, str) for m in ms):
        check_pairs(ms, turns)
    msgs: list[dict[str, Any]] = []
    if body.system:
        if isinstance(body.system, list):  # NOTE: issue 22: a string holds no block
            check_system_blocks(body.system)
        msgs.append({"role": "system", "content": content_text(body.system, "system")})
    rendered: list[list[dict[str, Any]]] = []
    for i, m in enumerate(ms):
        if m.role not in _ROLES:
            raise InvalidRequestError(
                f"messages.{i}.role: must be 'user' or 'assistant', got {m.role!r}",
                field=f"messages.{i}.role")
        _check_text(i, m, last=i == len(ms) - 1)
        # NOTE: each message's blocks are checked under its own path, before any merge
        rendered.append([{"role": m.role, "content": m.content}] if isinstance(m.content, str)
                        else anthropic_history(m.role, m.content, f"messages.{i}"))
    if turns is None:
        return msgs + [r for one in rendered for r in one]
    for t in turns:  # NOTE: a merged turn renders as the one combined message would
        msgs += (anthropic_history(t.role, t.content, f"messages.{t.first}") if t.merged
                 else rendered[t.first])
    return msgs


def _check_text(i: int, m: AnthropicMessage, *, last: bool) -> None:
    """As Anthropic refuses them (400s in its words): an empty message, unless it is the
    final assistant one (an empty prefill); an empty text block; a final assistant message
    (a prefill) that ends in whitespace; a malformed thinking block (anthropic_checks)."""
    if not isinstance(m.content, str):  # NOTE: issue 22: a string holds no thinking block
        check_thinking_blocks(m.content, f"messages.{i}")
    texts = ([m.content] if isinstance(m.content, str)
             else [b.get("text") for b in m.content if b.get("type") == "text"])
    prefill = last and m.role == "assistant"
    if not isinstance(m.content, str):
        j = next((j for j, b in enumerate(m.content)
                  if b.get("type") == "text" and b.get("text") == ""), None)
        if j is not None:
            raise InvalidRequestError(f"messages.{i}.content.{j}: text content blocks must "
                                      "be non-empty", field=f"messages.{i}.content.{j}")
    if not m.content and not prefill:
        raise InvalidRequestError(f"messages.{i}: all messages must have non-empty content "
                                  "except for the optional final assistant message",
                                  field=f"messages.{i}")
    tail = texts[-1] if texts and isinstance(texts[-1], str) else ""
    if prefill and tail and tail != tail.rstrip():
        raise InvalidRequestError(f"messages.{i}: final assistant content cannot end with "
                                  "trailing whitespace", field=f"messages.{i}")


def tool_plan(body: AnthropicRequest | AnthropicCountRequest) -> tl.ToolPlan | None:
    """The request's tool plan; no tools nor tool choice is no plan, without entering the
    tool module (issue 22: what :func:`coda.server.tools.anthropic_plan` answers then)."""
    if not body.tools and body.tool_choice is None:
        return None
    check_server_tools(body.tools)
    return tl.anthropic_plan(body.tools, body.tool_choice)


def _prompt_ids(st: ServerState, body: AnthropicRequest | AnthropicCountRequest,
                plan: tl.ToolPlan | None) -> list[int]:
    """The prompt's token ids: the chat template over system, messages and the plan's tools
    (a final assistant message is a prefill the model continues). CPU-bound: callers run it
    on a worker thread, never on the event loop."""
    msgs = chat_messages(body)
    prefill = msgs[-1]["role"] == "assistant"
    text = render_chat(st.engine, msgs, continue_final_message=prefill,
                       tools=plan.tools if plan else ())
    return st.encode(text, add_special_tokens=False, field="messages")


class AnthropicAdapter:
    """Messages as a :class:`~coda.server.create.Adapter`."""

    kind: Literal["anthropic"] = "anthropic"
    id_prefix = "msg_"
    id_header = "request-id"

    async def parse(self, st: ServerState, body: AnthropicRequest) -> Parsed:
        st.check_model(body.model)
        plan = tool_plan(body)
        show, budget = _thinking(body)
        ids = await asyncio.to_thread(_prompt_ids, st, body, plan)
        fmt = body.response_format
        grammar, grammar_field = None, "response_format"
        if body.output_config is not None or body.output_format is not None:  # NOTE: issue 22
            grammar, grammar_field = output_grammar(body.output_config, body.output_format)
        if grammar is not None and fmt is not None:
            raise InvalidRequestError(f"{grammar_field}: cannot be combined with Coda's "
                                      "response_format", field=grammar_field)
        tool = (tl.knob_fields(plan, grammar or fmt, grammar_field if grammar else
                               "response_format") if plan is not None else {})
        if grammar is not None and not tool:
            tool = {"grammar": grammar, "grammar_field": grammar_field}
        reasoning = st.reasoning(
            ids, budget=budget, budget_field="thinking.budget_tokens",
            grammar="grammar" in tool or (fmt is not None and fmt.type != "text"))
        spec = AnthropicRender(input_tokens=len(ids), tools=bool(plan and plan.active),
                               verify=body.stream_verify, thinking=reasoning is not None,
                               reasoning=show,
                               service_tier="standard" if body.service_tier else None)
        return plan_call(body, [ids], spec, call_id=new_id(self.id_prefix),
                         backpressure=st.settings.backpressure, stream=body.stream,
                         on_disconnect=body.on_disconnect,
                         max_tokens=body.max_tokens, max_tokens_field="max_tokens",
                         prompt_field="messages", stop=body.stop_sequences,
                         stop_field="stop_sequences", seed=body.seed,
                         temperature=body.temperature, top_p=body.top_p, reasoning=reasoning,
                         **tool)

    def final(self, record: Record, terminals: list[Terminal] | None) -> Response:
        spec = record.spec
        assert terminals is not None and isinstance(spec, AnthropicRender)
        rid, headers = record.id, {"request-id": record.id}
        c = collect(record.handles[0].stream)
        if is_failed(c.terminal):  # defect 4: error status, partial text and outcome, no retry
            return failed_json({"type": "error", "error": anthropic_error(c.terminal),
                                "id": rid, "content": [{"type": "text", "text": c.text}],
                                "coda": coda_extension(c.terminal)}, c.terminal, headers=headers)
        ext = coda_extension(c.terminal)
        content: list[dict[str, Any]] = [{"type": "text", "text": c.text}]
        if c.terminal.reasoning is not None and spec.reasoning:  # NOTE: issue 23
            content.insert(0, {"type": "thinking", "thinking": c.reasoning, "signature": ""})
        calls: list[tl.ToolCall] = []
        if spec.tools:
            text, calls, removed = tl.split(c.text)
            ext["tool_calls"] = {"count": len(calls), "removed_bytes": removed}
            content = ([{"type": "text", "text": text}] if text or not calls else []) + [
                _tool_use(k, rid) for k in calls]
        reason, stop = _stop_fields(c.terminal, len(calls))
        return JSONResponse({"id": rid, "type": "message", "role": "assistant",
                             "model": record.model, "content": content,
                             "stop_reason": reason, "stop_sequence": stop,
                             "usage": {**_usage(c.terminal, spec.input_tokens),
                                       **_tier(spec)},
                             "coda": ext}, headers=headers)


MESSAGES = AnthropicAdapter()
register_renderer(AnthropicRender, AnthropicRenderer)


@router.post("/v1/messages")
async def create_message(body: AnthropicRequest, request: Request) -> Response:
    """Anthropic Messages (streaming and not) with the Coda extensions."""
    return await create(request, await MESSAGES.parse(state_of(request), body), MESSAGES)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: AnthropicCountRequest, request: Request) -> Response:
    """Anthropic's token counting: the prompt ``POST /v1/messages`` would build from the same
    system, messages and tools, counted by the served model's tokenizer (nothing is queued)."""
    st = state_of(request)
    st.check_model(body.model)
    if body.thinking is not None:
        thinking_budget(body.thinking, None)  # NOTE: counted or not, checked as on /v1/messages
    ids = await asyncio.to_thread(_prompt_ids, st, body, tool_plan(body))
    return JSONResponse({"input_tokens": len(ids)})
