"""The stream of ``POST /v1/chat/completions`` and ``POST /v1/completions`` (issue 4 item 2;
SPEC P1–P3, L6): ``chat.completion.chunk`` / ``text_completion`` chunks over a call's n (×
prompts) engine streams, each with an SSE ``id`` (the engine sequence numbers, see
:func:`coda.server.sse.position_id`), ending with ``data: [DONE]``. The route and the
non-streamed answer are :mod:`coda.server.openai_routes` and :mod:`coda.server.openai_final`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coda.finish import Terminal
from coda.reader import replay
from coda.server import logprobs as lp
from coda.server import tools as tl
from coda.server.common import text_before
from coda.server.http_errors import is_failed, openai_error
from coda.server.mapping import (
    coda_extension,
    openai_finish_reason,
    openai_usage,
    prediction_usage,
    system_fingerprint,
)
from coda.server.records import Record
from coda.server.render_spec import OpenAIRender
from coda.server.sse import Frame, Renderer, position_id
from coda.stream import EventType, StreamEvent, TokenInfo


class OpenAIRenderer(Renderer):
    """Chunks of one chat / completion call over its n (× prompts) engine streams."""

    def __init__(self, record: Record, after: Sequence[int] | None) -> None:
        super().__init__(len(record.handles), after)
        spec = record.spec
        assert isinstance(spec, OpenAIRender)
        self.r, self.spec = record, spec
        self.continuous_usage = spec.continuous_usage
        self.skip = spec.skip_special
        if spec.verify:
            self.enable_verify(record.streams)
        # NOTE: tokens selected so far per choice (a resumed stream counts what it skipped)
        self.selected = [sum(len(e.tokens) for e in replay(h.stream)[:a + 1])
                         for h, a in zip(record.handles, self.after, strict=True)]
        self.chat = record.kind == "chat"
        self.include_usage, self.logprobs = spec.include_usage, spec.logprobs
        # NOTE: legacy text_offset continues where a resumed stream left off, after the echo.
        self.offsets = [len(self._echo(i)) + text_before(h.stream, a)
                        for i, (h, a) in enumerate(zip(record.handles, self.after,
                                                       strict=True))]
        # NOTE: tool calls are parsed out of the text (coda.server.tools); a resumed stream
        # primes each parser with the text it already sent.
        self.fingerprint: str | None = None
        self.parsers = ([tl.primed(e.text for e in replay(h.stream)
                                   if e.type is EventType.DELTA and e.seq <= a
                                   and not e.reasoning)
                         for h, a in zip(record.handles, self.after, strict=True)]
                        if spec.tools else None)

    def _echo(self, index: int) -> str:
        """The echoed prompt text of choice ``index`` ("" without echo)."""
        return self.spec.echo[index // self.spec.n] if self.spec.echo else ""

    def _echo_logprobs(self, index: int) -> Any:
        """The echoed prompt's legacy logprobs of choice ``index`` (None without them)."""
        spec = self.spec
        return spec.echo_logprobs[index // spec.n] if spec.echo_logprobs else None

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        tier = {"service_tier": self.spec.service_tier} if self.spec.service_tier else {}
        if self.fingerprint is None:  # NOTE: the start event's identity (the log's first)
            events = replay(self.r.handles[0].stream)
            self.fingerprint = system_fingerprint(events[0].model_snapshot if events else None)
        if self.include_usage and "usage" not in extra:
            extra["usage"] = None  # NOTE: as OpenAI: every chunk but the last says null
        return {"id": self.r.id, "object": obj, "created": self.r.created,
                "model": self.r.model, **tier, "system_fingerprint": self.fingerprint,
                "choices": choices, **extra}

    def on_event(self, index: int, ev: StreamEvent, positions: list[int]) -> list[Frame]:
        fid = position_id(positions)
        if ev.type is EventType.START:
            if not self.chat:
                if not self.spec.echo:
                    return []
                # NOTE: legacy echo: the prompt's text is the first chunk of its choice
                choice = {"index": index, "text": self._echo(index),
                          "logprobs": self._echo_logprobs(index), "finish_reason": None}
                return [Frame(self._chunk([choice], **self._runningreported_usage(index)), id=fid)]
            choice = {"index": index,
                      "delta": {"role": "assistant", "content": "", "refusal": None},
                      "logprobs": None, "finish_reason": None}
            return [Frame(self._chunk([choice], **self._runningreported_usage(index)), id=fid)]
        if ev.type is EventType.DELTA:
            self.selected[index] += len(ev.tokens)
            if ev.reasoning:  # NOTE: issue 23: never a tool call's text, never content
                if not self.spec.reasoning:
                    return []
                delta = {"reasoning": ev.text, "reasoning_content": ev.text}
                return [Frame(self._chunk([{"index": index, "delta": delta, "logprobs": None,
                                            "finish_reason": None}],
                                          **self._runningreported_usage(index),
                                          **self.stamp(index, ev)), id=fid)]
            if self.parsers is not None:
                return self._tool_frames(index, self.parsers[index].feed(ev.text), ev, fid)
            return [Frame(self._chunk([self._delta_choice(index, ev)],
                                      **self._runningreported_usage(index), **self.stamp(index, ev)),
                          id=fid)]
        terminal = ev.terminal
        assert terminal is not None
        ext = {"index": index, **coda_extension(
            terminal, self.r.network_send_s(index, self.network_send_s))}
        frames: list[Frame] = []
        if self.parsers is not None:
            parser = self.parsers[index]
            frames = self._tool_frames(index, parser.finish(), None, fid)
            self.stamp_into(index, ext)  # NOTE: unframed bytes (issue 20 D5), on the last chunk
            ext["tool_calls"] = {"count": parser.calls, "removed_bytes": parser.removed_bytes}
        # NOTE: issue 22: the trailing logprobs only where the request asked for logprobs
        trailing = lp.reported_trailing(terminal) if self.logprobs else ()
        if is_failed(terminal):
            # NOTE: issue 20 D8: the textless last tokens' logprobs, which the 500 body lists,
            # come in one chunk before the in-band error frame (the openai SDK raises APIError
            # on it), then [DONE]: streamed and non-streamed list the same entries.
            pre = ([Frame(self._chunk([self._trailing_choice(index, trailing, None)]), id=fid)]
                   if self.logprobs and trailing else [])
            return [*pre, Frame({"error": openai_error(terminal), "coda": ext}, id=fid)]
        reason = openai_finish_reason(terminal.finish_reason)
        if self.parsers is not None and self.parsers[index].calls and reason == "stop":
            reason = "function_call" if self.spec.legacy_functions else "tool_calls"
        # NOTE: textless last tokens: their logprobs on the final chunk
        choice = self._trailing_choice(index, trailing if self.logprobs else (), reason)
        self.selected[index] = terminal.usage.selected_tokens
        return [*frames,
                Frame(self._chunk([choice], coda=ext, **self._runningreported_usage(index)), id=fid)]

    def _trailing_choice(self, index: int, trailing: Sequence[TokenInfo],
                         reason: str | None) -> dict[str, Any]:
        """An empty choice of the last chunk, with the logprobs of ``trailing`` if any."""
        choice: dict[str, Any] = ({"index": index, "delta": {}, "logprobs": None,
                                   "finish_reason": reason} if self.chat else
                                  {"index": index, "text": "", "logprobs": None,
                                   "finish_reason": reason})
        if trailing:
            at = self.offsets[index]
            choice["logprobs"] = ({"content": lp.chat_entries(trailing, skip_special=self.skip),
                                   "refusal": None}
                                  if self.chat else lp.legacy_logprobs(
                                      trailing, at, at, skip_special=self.skip))
        return choice

    def _runningreported_usage(self, index: int) -> dict[str, Any]:
        """vLLM's ``continuous_usage_stats``: the choice's usage so far on every chunk."""
        if not self.continuous_usage:
            return {}
        prompt = self.spec.prompt_tokens[index // self.spec.n]
        done = self.selected[index]
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": done,
                          "total_tokens": prompt + done}}

    def _tool_frames(self, index: int, items: list[tl.Item], ev: StreamEvent | None,
                     fid: str) -> list[Frame]:
        """Text and complete calls of a tools request as one chunk (none if both are empty).
        With ``stream_verify`` the chunk's stamp covers every delta since the last stamp (issue
        20 D5): a delta whose bytes are held back or inside an open call makes no chunk of its
        own."""
        if ev is not None:
            self.take(index, ev)
        text = tl.texts(items)
        calls = [tl.openai_call(c, self.r.id, delta=True, choice=index) for c in items
                 if isinstance(c, tl.ToolCall)]
        logprobs = ({"content": lp.chat_entries(ev.tokens, skip_special=self.skip),
                     "refusal": None} if self.logprobs and ev is not None else None)
        if not text and not calls and logprobs is None:
            return []
        delta: dict[str, Any] = {"content": text} if text or not calls else {}
        if calls and self.spec.legacy_functions:  # NOTE: one call at most (never parallel)
            delta["function_call"] = calls[0]["function"]
        elif calls:
            delta["tool_calls"] = calls
        chunk = self._chunk([{"index": index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": None}])
        self.stamp_last(index, [chunk])
        return [Frame(chunk, id=fid)]

    def _delta_choice(self, index: int, ev: StreamEvent) -> dict[str, Any]:
        text = ev.text
        if self.chat:
            logprobs = ({"content": lp.chat_entries(ev.tokens, skip_special=self.skip),
                         "refusal": None} if self.logprobs else None)
            return {"index": index, "delta": {"content": text}, "logprobs": logprobs,
                    "finish_reason": None}
        start = self.offsets[index]
        self.offsets[index] += len(text)
        legacy = (lp.legacy_logprobs(ev.tokens, start, self.offsets[index],
                                     skip_special=self.skip)
                  if self.logprobs else None)
        return {"index": index, "text": text, "logprobs": legacy, "finish_reason": None}

    def footer(self) -> list[Frame]:
        terminals = [h.stream.terminal for h in self.r.handles]
        fid = position_id([h.stream.last_seq for h in self.r.handles])
        frames = []
        if self.include_usage and all(t is not None for t in terminals):
            done = [t for t in terminals if t is not None]
            frames.append(Frame(self._chunk([], usage=reported_usage(done, self.spec)), id=fid))
        frames.append(Frame("[DONE]", id=fid))
        return frames


def reported_usage(terminals: list[Terminal], spec: OpenAIRender) -> dict[str, Any]:
    """The answer's ``usage`` (the final object's and the ``include_usage`` chunk's): with a
    ``prediction``, its prediction token counts too."""
    usage = openai_usage(terminals, spec.n)
    return prediction_usage(usage, terminals) if spec.prediction else usage
