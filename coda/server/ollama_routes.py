"""``POST /api/chat`` and ``POST /api/generate``: the Ollama API (issue 23 item 2; SPEC P1,
P2, P4, L4–L6, S1).

Both run the one create handler (:mod:`coda.server.common`). A stream is NDJSON
(:mod:`coda.server.ndjson`): one object per delta (``message.content`` / ``response``, a
complete tool call as ``message.tool_calls``), then exactly one ``done: true`` object, last,
with ``done_reason``, the counts, the durations and the exact outcome in ``coda``
(:mod:`coda.server.ollama_wire`); nothing follows it. Stop strings are never in the text
(S1: the engine holds them back). A FAILED request ends its stream with one ``{"error": ...,
"done": true, "coda": ...}`` line — the official client raises ``ResponseError`` on it — and a
call that did not stream gets HTTP 500 (400 for a request error) with ``{"error": ...}``.

``format`` (``"json"`` or a JSON schema) is Coda's structured output grammar, ``tools`` Coda's
tool calling (:mod:`coda.server.tools`), ``options`` the sampler
(:mod:`coda.server.ollama_options`). ``keep_alive: 0`` unloads the model once its requests
end where the server runs several models (:mod:`coda.server.model_router`); any other
``keep_alive``, and every ``keep_alive`` with one model served, is accepted with no effect (the
model stays loaded for the server's life, or until the memory budget's LRU unloads it). An
empty ``messages`` / ``prompt`` is Ollama's "load the model" call: ``done_reason: "load"`` at
once, or ``"unload"`` with ``keep_alive: 0`` and several models
(:func:`coda.server.ollama_info.load_answer`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from coda.errors import InvalidRequestError
from coda.finish import Terminal
from coda.reader import replay
from coda.reasoning import ReasoningSpec
from coda.server import logprobs as lp
from coda.server import tools as tl
from coda.server.chat import render_chat
from coda.server.common import collect, create, new_id, state_of
from coda.server.http_errors import error_message, failed_json, is_failed
from coda.server.ndjson import JSONLine, NDJSONRenderer
from coda.server.ollama_checks import check_body
from coda.server.ollama_context import check_context, done_context, joined
from coda.server.ollama_info import load_answer, unload_when_idle
from coda.server.ollama_options import max_tokens
from coda.server.ollama_schemas import OllamaChatRequest, OllamaGenerateRequest, model_name
from coda.server.ollama_wire import (
    chat_messages,
    created_at,
    done_fields,
    keep_alive_zero,
    tool_call,
)
from coda.server.params import plan_call, sampled_top_p
from coda.server.records import Record, register_renderer
from coda.server.render_spec import OllamaRender, RecordKind
from coda.server.sse import Frame
from coda.server.state import ServerState
from coda.stream import EventType, StreamEvent, TokenInfo

router = APIRouter()
OllamaBody = OllamaChatRequest | OllamaGenerateRequest


def _head(record: Record) -> dict[str, Any]:
    spec = record.spec
    assert isinstance(spec, OllamaRender)
    return {"model": spec.model, "created_at": created_at(record.created)}


def _piece(record: Record, chat: bool, item: tl.Item, thinking: bool = False
           ) -> dict[str, Any]:
    """One streamed object: a text piece, a reasoning piece (``thinking``) or a complete tool
    call (chat only)."""
    if not chat:
        assert isinstance(item, str)
        if thinking:
            return {**_head(record), "response": "", "thinking": item, "done": False}
        return {**_head(record), "response": item, "done": False}
    if thinking:
        assert isinstance(item, str)
        return {**_head(record), "message": {"role": "assistant", "content": "",
                                             "thinking": item}, "done": False}
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    if isinstance(item, str):
        message["content"] = item
    else:
        message["tool_calls"] = [tool_call(item)]
    return {**_head(record), "message": message, "done": False}


def _failed(record: Record, terminal: Terminal, ext: dict[str, Any]) -> dict[str, Any]:
    return {**_head(record), "error": error_message(terminal), "done": True, "coda": ext}


class OllamaRenderer(NDJSONRenderer):
    """One JSON line per delta (or tool call), then the one ``done`` line."""

    def __init__(self, record: Record, after: list[int] | None) -> None:
        super().__init__(1, after)
        spec = record.spec
        assert isinstance(spec, OllamaRender)
        self.r, self.chat, self.thinking = record, spec.chat, spec.thinking
        self.logprobs, self.skip = spec.logprobs, spec.skip_special
        # NOTE: a replay primes the parser with the text already sent (P3)
        self.parser = (tl.primed(e.text for e in replay(record.handles[0].stream)
                                 if e.type is EventType.DELTA and e.seq <= self.after[0])
                       if spec.tools else None)

    def _lines(self, items: list[tl.Item], tokens: Sequence[TokenInfo] = (),
               thinking: bool = False) -> list[Frame]:
        pieces = [_piece(self.r, self.chat, i, thinking) for i in items if i != ""]
        if self.logprobs and tokens:
            # NOTE: a token's logprobs travel with the line of its text (an empty line where
            # its bytes wait for the rest of a character), so the lines hold every token
            pieces = pieces or [_piece(self.r, self.chat, "", thinking)]
            pieces[0]["logprobs"] = lp.chat_entries(tokens, skip_special=self.skip)
        return [JSONLine(p) for p in pieces]

    def on_event(self, index: int, ev: StreamEvent, positions: list[int]) -> list[Frame]:
        if ev.type is EventType.START:
            return []
        if ev.type is EventType.DELTA:
            if ev.reasoning:  # NOTE: issue 23: reasoning is never content nor a tool call
                return self._lines([ev.text] if self.thinking else [], ev.tokens, True)
            return self._lines(self.parser.feed(ev.text) if self.parser else [ev.text],
                               ev.tokens)
        terminal = ev.terminal
        assert terminal is not None
        frames = self._lines(self.parser.finish()) if self.parser else []
        if self.logprobs and not is_failed(terminal):
            frames += self._lines([], lp.reported_trailing(terminal))
        end = done_fields(terminal, self.r.network_send_s(index, self.network_send_s))
        if self.parser is not None:
            end["coda"]["tool_calls"] = {"count": self.parser.calls,
                                         "removed_bytes": self.parser.removed_bytes}
        if is_failed(terminal):
            return [*frames, JSONLine(_failed(self.r, terminal, end["coda"]))]
        context = {} if self.chat else done_context(self.r)  # NOTE: a chat's done has none
        return [*frames, JSONLine({**_piece(self.r, self.chat, ""), **end, **context})]


def _thinking(st: ServerState, body: OllamaBody, ids: list[int]) -> ReasoningSpec | None:
    """The reasoning split of a model with ``<think>`` markers (issue 23 item 3): always made
    (stops apply to the answer only; ``format`` or tools constrain the answer only), shown as
    ``thinking`` unless ``think`` is false; asking for ``think`` on a model without markers
    is a 400."""
    spec = st.reasoning(ids, budget=None, budget_field="think")
    if spec is None and body.think not in (None, False, "none"):
        raise InvalidRequestError(f"think: {body.model!r} does not support thinking",
                                  field="think")
    return spec


def _prompt(st: ServerState, body: OllamaBody, plan: tl.ToolPlan | None) -> list[int]:
    """The prompt's ids (CPU-bound: off the event loop). ``raw`` generate: the prompt as is."""
    if isinstance(body, OllamaGenerateRequest):
        return joined(body.context, _new_prompt(st, body, plan))
    return _new_prompt(st, body, plan)


def _new_prompt(st: ServerState, body: OllamaBody, plan: tl.ToolPlan | None) -> list[int]:
    if isinstance(body, OllamaGenerateRequest) and body.raw:
        # NOTE: after a context the tokenizer's own BOS would open a second sequence
        return st.encode(body.prompt, add_special_tokens=not body.context)
    if isinstance(body, OllamaChatRequest):
        msgs, field = chat_messages(body.messages), "messages"
    else:
        msgs = [*chat_messages([], body.system), {"role": "user", "content": body.prompt}]
        field = "prompt"
    text = render_chat(st.engine, msgs, field=field, tools=plan.tools if plan else (),
                       continue_final_message=continues(msgs))
    bos = st.engine.chat.bos_token
    if isinstance(body, OllamaGenerateRequest) and body.context and bos and text.startswith(bos):
        text = text[len(bos):]  # NOTE: the context opened the sequence; its BOS is not repeated
    return st.encode(text, add_special_tokens=False, field=field)


def continues(msgs: Sequence[dict[str, Any]]) -> bool:
    """A chat whose last message is the assistant's (text, no tool calls) is continued, as
    Ollama's templates leave that turn open: the answer goes on from its text (a prefill) and
    holds only what follows it. It started a new assistant turn after the closed one."""
    last = msgs[-1] if msgs else {}
    return last.get("role") == "assistant" and not last.get("tool_calls")


def tool_plan(body: OllamaBody) -> tl.ToolPlan | None:
    """A chat's tool plan (generate has none); no tools nor tool choice is no plan, without
    entering the tool module (issue 22: what :func:`coda.server.tools.openai_plan` answers)."""
    if not isinstance(body, OllamaChatRequest) or (not body.tools and body.tool_choice is None):
        return None
    return tl.openai_plan(body.tools, body.tool_choice, None)


class OllamaAdapter:
    """``/api/chat`` or ``/api/generate`` as a :class:`~coda.server.common.Adapter`."""

    kind: RecordKind = "ollama"
    id_header: str | None = "x-request-id"

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.id_prefix = "ollama-chat-" if chat else "ollama-gen-"

    async def parse(self, st: ServerState, body: OllamaBody) -> Record:
        st.check_model(model_name(body.model))
        check_body(body)
        if isinstance(body, OllamaGenerateRequest):
            check_context(st.engine.tokenizer, body.context)
        plan = tool_plan(body)
        grammar = body.grammar()
        o = body.options
        tool_knobs = ((tl.knob_fields(plan, grammar, "format") if plan is not None else {})
                      or {"grammar": grammar})
        ids = await asyncio.to_thread(_prompt, st, body, plan)  # NOTE: CPU-bound
        reasoning = _thinking(st, body, ids)
        if body.logprobs and plan is not None and plan.active:
            # NOTE: a call's text is cut out of the token stream: no token maps onto a line
            raise InvalidRequestError("logprobs: not supported with tools", field="logprobs")
        spec = OllamaRender(chat=self.chat, model=body.model, tools=bool(plan and plan.active),
                            thinking=reasoning is not None and body.think not in (False, "none"),
                            logprobs=body.logprobs, skip_special=body.skip_special_tokens,
                            prompt_ids=() if self.chat else tuple(ids))
        budget = max_tokens(o)
        return plan_call(
            body, [ids], spec, call_id=new_id(self.id_prefix),
            kind=self.kind, model=st.engine.model_name,
            backpressure=st.settings.backpressure, stream=body.stream,
            on_disconnect=body.on_disconnect,
            max_tokens=budget, max_tokens_field="options.num_predict",
            prompt_field="messages" if self.chat else "prompt",
            stop=o.stop if o else None, stop_field="options.stop",
            seed=o.seed if o else None, temperature=o.temperature if o else None,
            top_p=sampled_top_p(o.top_p) if o else None,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            presence_penalty=o.presence_penalty if o else None,
            frequency_penalty=o.frequency_penalty if o else None, reasoning=reasoning,
            # NOTE: a grammar from ``format`` is named so (Ollama's field), not response_format
            grammar_field="format" if grammar is not None else "response_format", **tool_knobs)

    def final(self, record: Record, terminals: list[Terminal] | None) -> Response:
        assert terminals is not None
        spec = record.spec
        assert isinstance(spec, OllamaRender)
        c = collect(record.handles[0].stream)
        end = done_fields(c.terminal)
        text, calls = c.text, list[tl.ToolCall]()
        if spec.tools:
            text, calls, removed = tl.split(c.text)
            end["coda"]["tool_calls"] = {"count": len(calls), "removed_bytes": removed}
        headers = {"x-request-id": record.id}
        if is_failed(c.terminal):  # NOTE: the partial answer travels with the error
            body = {**_failed(record, c.terminal, end["coda"]),
                    ("message" if spec.chat else "response"): (
                        {"role": "assistant", "content": text} if spec.chat else text)}
            return failed_json(body, c.terminal, headers=headers)
        thinking = ({"thinking": c.reasoning}
                    if spec.thinking and c.terminal.reasoning is not None else {})
        if spec.logprobs:  # NOTE: every token's, in order (the textless last ones included)
            end["logprobs"] = lp.chat_entries((t for _, tokens in c.deltas for t in tokens),
                                              skip_special=spec.skip_special)
        if spec.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text, **thinking}
            if calls:
                message["tool_calls"] = [tool_call(k) for k in calls]
            return JSONResponse({**_head(record), "message": message, **end}, headers=headers)
        return JSONResponse({**_head(record), "response": text, **thinking, **end,
                             **done_context(record)}, headers=headers)


CHAT = OllamaAdapter(chat=True)
GENERATE = OllamaAdapter(chat=False)
register_renderer(OllamaRender, OllamaRenderer)


@router.post("/api/chat")
async def ollama_chat(body: OllamaChatRequest, request: Request) -> Response:
    """Ollama chat (streamed NDJSON unless ``stream: false``)."""
    return await _run(request, body, CHAT, empty=not body.messages)


@router.post("/api/generate")
async def ollama_generate(body: OllamaGenerateRequest, request: Request) -> Response:
    """Ollama generate: ``prompt`` (and ``system``) through the chat template, or ``raw``."""
    return await _run(request, body, GENERATE, empty=not body.prompt)


async def _run(request: Request, body: OllamaBody, adapter: OllamaAdapter, *,
               empty: bool) -> Response:
    if empty:
        st = state_of(request)
        st.check_model(model_name(body.model))
        return load_answer(st, body, chat=adapter.chat)
    response = await create(request, await adapter.parse(state_of(request), body), adapter)
    if keep_alive_zero(body.keep_alive):
        unload_when_idle(state_of(request).engine)
    return response
