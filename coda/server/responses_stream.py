"""The Responses API's event stream (issue 4 item 2; SPEC P1–P3): a pure function of the
engine's event log, so ``sequence_number`` (also the SSE ``id``) is the same on every replay.

``response.created`` 0, ``response.in_progress`` 1, then, with the first delta (or the end:
no item is announced before the model writes, as OpenAI's), ``output_item.added`` 2,
``content_part.added`` 3, one ``output_text.delta`` per engine delta, then
``output_text.done``, ``content_part.done``, ``output_item.done`` and exactly one of
``response.completed | response.incomplete | response.failed`` last. A reasoning model's split
output (issue 23) opens with a ``reasoning`` item instead (output index 0:
``output_item.added``, ``reasoning_text.delta``…, ``reasoning_text.done``,
``output_item.done``), and the message item follows at output index 1. With tools, calls and
text open their items in the order the model wrote them (issue 20 D5 stamps included).
A ``background`` response's stream opens as OpenAI's: ``response.created`` 0 and
``response.queued`` 1 (status ``queued``), then ``response.in_progress`` with its ``start``
event, which the engine writes when it admits the request (before the prefill; as
:func:`response_object` reads it), then the rest.
"""

from __future__ import annotations

from typing import Any

from coda.server import logprobs as lp
from coda.server import tools as tl
from coda.server.mapping import responses_status
from coda.server.records import Record
from coda.server.responses_object import (
    call_item,
    item_id,
    message_item,
    reasoning_item,
    response_object,
    spec_of,
)
from coda.server.sse import Frame, Renderer
from coda.stream import EventType, StreamEvent


def _is_delta(obj: dict[str, Any]) -> bool:
    return obj.get("type") in ("response.output_text.delta",
                               "response.function_call_arguments.delta")


class ResponsesRenderer(Renderer):
    """Deterministic Responses events; frames numbered ``<= starting_after`` are skipped."""

    position_ids = False  # NOTE: every frame carries its own sequence number

    def __init__(self, record: Record, after: list[int] | None) -> None:
        super().__init__(1, [-1])  # NOTE: always regenerate from the start (deterministic)
        spec = spec_of(record)
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
        if self.r.background:  # NOTE: queued until its start event (on_event)
            return (self._emit({"type": "response.created", "response": snap})
                    + self._emit({"type": "response.queued", "response": snap}))
        return (self._emit({"type": "response.created", "response": snap})
                + self._emit({"type": "response.in_progress",
                              "response": {**snap, "status": "in_progress"}}))

    def on_event(self, index: int, ev: StreamEvent, positions: list[int]) -> list[Frame]:
        """A background response's ``start`` (written at admission: the engine works on it,
        responses_object) sends ``response.in_progress`` before the start's frames."""
        if not (self.r.background and ev.type is EventType.START):
            return self._on_event(index, ev, positions)
        snap = response_object(self.r, initial=True)
        return (self._emit({"type": "response.in_progress",
                            "response": {**snap, "status": "in_progress"}})
                + self._on_event(index, ev, positions))

    def _close_reasoning(self) -> list[dict[str, Any]]:
        """The reasoning item's end (once, before the first item after it)."""
        if self.reasoning is None or self.message_open or self.calls:
            return []
        rid = "rs_" + self.r.id.removeprefix("resp_")
        return [{"type": "response.reasoning_text.done", "item_id": rid, "output_index": 0,
                 "content_index": 0, "text": self.reasoning},
                {"type": "response.output_item.done", "output_index": 0,
                 "item": reasoning_item(self.r, self.reasoning, "completed")}]

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
                       "item": message_item(self.r, "", "in_progress")},
                      {"type": "response.content_part.added", **ids,
                       "part": {"type": "output_text", "text": "", "annotations": [],
                                "logprobs": []}}]

    def _open_message(self) -> list[Frame]:
        return [f for obj in self._message_opening() for f in self._emit(obj)]

    def _ids(self) -> dict[str, Any]:
        return {"item_id": item_id(self.r), "output_index": self.message_at, "content_index": 0}

    def _reasoning_delta(self, index: int, ev: StreamEvent) -> list[Frame]:
        """Issue 23: a reasoning delta: the reasoning item opens at the first."""
        if not self.show_reasoning or self.message_open or self.calls:
            return []
        out: list[Frame] = []
        rid = "rs_" + self.r.id.removeprefix("resp_")
        if self.reasoning is None:
            self.reasoning = ""
            out += self._emit({"type": "response.output_item.added", "output_index": 0,
                               "item": reasoning_item(self.r, "", "in_progress")})
        self.reasoning += ev.text
        return out + self._emit({"type": "response.reasoning_text.delta", "item_id": rid,
                                 "output_index": 0, "content_index": 0, "delta": ev.text,
                                 **self.stamp(index, ev)})

    def _on_event(self, index: int, ev: StreamEvent, positions: list[int]) -> list[Frame]:
        if ev.type is EventType.START:
            # NOTE: P1, as OpenAI: no item before the model writes (a prompt still prefilling
            # has output []): the message item opens at the first answer delta (or the end), a
            # split output's reasoning item at the first reasoning delta (issue 23), with tools
            # the message item at the first text (layout)
            return []
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
            added = call_item(self.r, item, "in_progress")
            done = call_item(self.r, item, "completed")
            out += [{"type": "response.output_item.added", **at, "item": added},
                    {"type": "response.function_call_arguments.delta", **at,
                     "item_id": added["id"], "delta": item.arguments},
                    {"type": "response.function_call_arguments.done", **at,
                     "item_id": added["id"], "arguments": item.arguments},
                    {"type": "response.output_item.done", **at, "item": done}]
        return out
