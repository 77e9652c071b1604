"""Anthropic Messages on the wire (SPEC P1–P4): the stream's events (:class:`AnthropicRenderer`)
and the pieces the whole message shares with them (stop fields, ``tool_use`` blocks, usage).

Stream: ``message_start``, ``content_block_start``, ``ping`` (with the engine's first event
after start, so the usage states the prefix-cache lookup's result: issue 20 D9),
``content_block_delta`` per delta, then ``content_block_stop``, ``message_delta`` (``stop_reason``
``end_turn`` | ``max_tokens`` | ``stop_sequence`` with the matched ``stop_sequence``, and the
exact outcome in ``coda``) and ``message_stop`` — or one in-band ``error`` event when the model
failed. A reasoning model's split output (issue 23) opens its blocks lazily: a ``thinking``
block (``thinking_delta``s, an empty ``signature_delta``), then the text block. ``max_tokens:
0`` (cache pre-warming) opens no block: ``message_start``, ``ping``, ``message_delta``
(``max_tokens``), ``message_stop``; nor does an answer that ended before any text (its first
event is the terminal), as Anthropic streams an empty turn (``content: []``).
"""

from __future__ import annotations

import json
from typing import Any

from coda.finish import Terminal
from coda.reader import replay
from coda.server import tools as tl
from coda.server.http_errors import anthropic_error, is_failed
from coda.server.mapping import anthropic_stop_reason, coda_extension
from coda.server.records import Record
from coda.server.render_spec import AnthropicRender
from coda.server.sse import Frame, Renderer, position_id
from coda.stream import EventType, StreamEvent


def stop_fields(terminal: Terminal, calls: int = 0) -> tuple[str, str | None]:
    reason = anthropic_stop_reason(terminal.finish_reason)
    if calls and reason == "end_turn":
        reason = "tool_use"
    stop = terminal.stop.stop if terminal.stop is not None else None
    return reason, stop if isinstance(stop, str) else None


def tool_use_block(call: tl.ToolCall, rid: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.call_id(rid).removeprefix("call_"),
            "name": call.name, "input": json.loads(call.arguments)}


def answer_blocks(text: str, rid: str) -> tuple[list[dict[str, Any]], int, int]:
    """A whole answer with tools as content blocks, in the order the model wrote them (K2,
    P1): each run of text between calls one ``text`` block, each call a ``tool_use`` block,
    as the stream opens and closes them (:meth:`AnthropicRenderer._blocks`); with the
    number of calls and the bytes of call syntax removed."""
    p = tl.ToolCallParser()
    blocks: list[dict[str, Any]] = []
    for item in p.feed(text) + p.finish():
        if isinstance(item, tl.ToolCall):
            blocks.append(tool_use_block(item, rid))
        elif item and blocks and blocks[-1]["type"] == "text":
            blocks[-1]["text"] += item  # NOTE: the stream's open text block takes it too
        elif item:
            blocks.append({"type": "text", "text": item})
    return blocks, p.calls, p.removed_bytes


def usage_tier(spec: AnthropicRender) -> dict[str, str]:
    """``usage.service_tier`` / ``usage.speed``, each when the request named one: the one
    local tier and speed, "standard"."""
    out = {"service_tier": spec.service_tier} if spec.service_tier else {}
    return {**out, "speed": spec.speed} if spec.speed else out


def usage_of(terminal: Terminal | None, input_tokens: int, cached: int = 0) -> dict[str, int]:
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
        self.tier = usage_tier(spec)
        self.warm = spec.warm  # NOTE: max_tokens 0: no content block (render_spec)
        # NOTE: with tools, blocks open lazily: text (index k) or tool_use, one at a time
        self.parser: tl.ToolCallParser | None = None
        self.block = -1          # index of the last block started
        self.text_open = False
        # NOTE: issue 23: a split output opens its blocks lazily: thinking, then text
        self.thinking = spec.thinking
        self.show_reasoning = spec.reasoning
        self.omit_thinking = spec.omit_thinking  # NOTE: the block is sent, its text is not
        self.thinking_open = False
        self.empty = False  # NOTE: set at the first event: the answer holds no text at all
        unstamped = 0  # NOTE: bytes before the resume point that no stamped frame covered
        if spec.tools:
            self.parser = tl.ToolCallParser()
        if self.thinking or self.parser is not None:
            for e in replay(record.handles[0].stream):
                if e.type is EventType.DELTA and e.seq <= self.after[0]:
                    # NOTE: replays the block state (resume)
                    out = (self._split_blocks(0, e, "") if self.thinking
                           else self._parsed(0, e, ""))  # NOTE: no verify yet: no stamp
                    if self.parser is not None:  # NOTE: issue 20 D5: bytes a later stamp covers
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
            usage = {**usage_of(ev.terminal, prompt), "output_tokens": 0}
        else:
            usage = usage_of(None, prompt, ev.cached_prompt_tokens or 0)
        message: dict[str, Any] = {
            "id": self.r.id, "type": "message", "role": "assistant", "model": self.r.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {**usage, **self.tier}}
        # NOTE: a terminal first (the answer ended before any text: EOS or a stop sequence
        # at once) opens no block, as Anthropic streams an empty turn (content [])
        self.empty = ev.terminal is not None
        if self.parser is not None or self.thinking or self.warm or self.empty:
            return [self._frame("message_start", fid, message=message), self._frame("ping", fid)]
        return [self._frame("message_start", fid, message=message),
                self._frame("content_block_start", fid, index=0,
                            content_block={"type": "text", "text": ""}),
                self._frame("ping", fid)]

    def _split_blocks(self, index: int, ev: StreamEvent, fid: str) -> list[Frame]:
        """Issue 23: a delta of a split output: a reasoning delta goes to the thinking block
        (opened at the first), an answer delta to the text block (the thinking block, if open,
        is closed first), or with tools to the tool-call parser's blocks, as without a split.
        The signature is empty: Coda signs nothing (docs/api.md)."""
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
            if self.omit_thinking:
                return out
            out.append(self._frame("content_block_delta", fid, index=self.block,
                                   delta={"type": "thinking_delta", "thinking": ev.text},
                                   **self.stamp(0, ev)))
            return out
        out += self._close_thinking(fid)
        if self.parser is not None:
            return out + self._parsed(index, ev, fid)
        return out + self._text(fid, ev.text, **self.stamp(0, ev))

    def _parsed(self, index: int, ev: StreamEvent, fid: str) -> list[Frame]:
        """An answer delta with tools: the tool-call parser's text and ``tool_use`` blocks."""
        assert self.parser is not None
        self.take(index, ev)  # NOTE: issue 20 D5: the next block delta's stamp covers it
        out = self._blocks(self.parser.feed(ev.text), fid)
        self.stamp_last(index, [f.data for f in out], _is_block_delta)
        return out

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
                return self._split_blocks(index, ev, fid)
            if ev.reasoning:
                return []  # NOTE: issue 23: reasoning dropped (thinking disabled)
            if self.parser is not None:
                return self._parsed(index, ev, fid)
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
        reason, stop = stop_fields(terminal, calls)
        # NOTE: max_tokens 0 (warm) opened no content block: none is closed
        if self.thinking and not self.warm:
            frames = self._close_thinking(fid) + frames
            # NOTE: an empty answer after a thinking block sent, without tools: still one
            # text block, as the whole message's; else none (reasoning dropped: content [],
            # the empty turn's; with tools the thinking and calls only)
            if self.parser is None and self.show_reasoning and not self.text_open:
                self.block += 1
                self.text_open = True
                frames.append(self._frame("content_block_start", fid, index=self.block,
                                          content_block={"type": "text", "text": ""}))
        if self.parser is None and not self.thinking and not self.warm and not self.empty:
            frames.append(self._frame("content_block_stop", fid, index=0))
        elif self.text_open:
            frames.append(self._frame("content_block_stop", fid, index=self.block))
        return [*frames,
                self._frame("message_delta", fid,
                            delta={"stop_reason": reason, "stop_sequence": stop},
                            usage={**usage_of(terminal, self.input_tokens), **self.tier},
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
            block = {**tool_use_block(item, self.r.id), "input": {}}
            out += [self._frame("content_block_start", fid, index=self.block,
                                content_block=block),
                    self._frame("content_block_delta", fid, index=self.block,
                                delta={"type": "input_json_delta",
                                       "partial_json": item.arguments}),
                    self._frame("content_block_stop", fid, index=self.block)]
        return out


def _is_block_delta(obj: dict[str, Any]) -> bool:
    return obj.get("type") == "content_block_delta"
