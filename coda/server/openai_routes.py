"""``POST /v1/chat/completions`` and ``POST /v1/completions`` (issue 4 item 2; SPEC P1–P4, L4–L6).

Streams are ``chat.completion.chunk`` / ``text_completion`` events, each with an SSE ``id``
(the engine sequence numbers, see :func:`coda.server.sse.position_id`) and ending with
``data: [DONE]``. Every final chunk carries the closest OpenAI ``finish_reason`` and the exact
outcome in ``coda`` (finish reason, matched stop, split usage, timings).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from coda.errors import InvalidRequestError
from coda.server import logprobs as lp
from coda.server.chat import render_chat
from coda.server.common import collect, new_id, now, state_of, stream_or_wait, text_before
from coda.server.http_errors import ApiError
from coda.server.mapping import coda_extension, is_model_failure, openai_finish_reason, openai_usage
from coda.server.params import Knobs, build_requests, encode, rename_map
from coda.server.schemas import ChatCompletionRequest, CompletionRequest
from coda.server.sse import Frame, Renderer, position_id
from coda.server.state import Record, ServerState
from coda.stream import EventType, StreamEvent, Terminal

router = APIRouter()


class OpenAIRenderer(Renderer):
    """Chunks of one chat / completion call over its n (× prompts) engine streams."""

    def __init__(self, record: Record, *, tokenizer: Any, include_usage: bool,
                 logprobs: bool, after: Sequence[int] | None) -> None:
        super().__init__(len(record.handles), after)
        self.r, self.tok = record, tokenizer
        self.chat = record.kind == "chat"
        self.include_usage, self.logprobs = include_usage, logprobs
        # NOTE: legacy text_offset continues where a resumed stream left off.
        self.offsets = [text_before(h.stream, a) for h, a in zip(record.handles, self.after,
                                                                  strict=True)]

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.r.id, "object": obj, "created": self.r.created,
                "model": self.r.model, "choices": choices, **extra}

    def on_event(self, index: int, ev: StreamEvent, positions: list[int]) -> list[Frame]:
        fid = position_id(positions)
        if ev.type is EventType.START:
            if not self.chat:
                return []
            choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}
            return [Frame(self._chunk([choice]), id=fid)]
        if ev.type is EventType.DELTA:
            return [Frame(self._chunk([self._delta_choice(index, ev)]), id=fid)]
        terminal = ev.terminal
        assert terminal is not None
        ext = {"index": index, **coda_extension(terminal, self.network_send_s)}
        if is_model_failure(terminal):
            err = {"message": terminal.error_message or "model error", "type": "server_error",
                   "param": None, "code": (terminal.error_code.value if terminal.error_code
                                           else "model_error")}
            return [Frame({"error": err, "coda": ext}, id=fid)]
        reason = openai_finish_reason(terminal.finish_reason)
        choice: dict[str, Any] = ({"index": index, "delta": {}, "logprobs": None,
                                   "finish_reason": reason} if self.chat else
                                  {"index": index, "text": "", "logprobs": None,
                                   "finish_reason": reason})
        trailing = lp.reported_trailing(terminal)
        if self.logprobs and trailing:  # textless last tokens: logprobs on the final chunk
            at = self.offsets[index]
            choice["logprobs"] = ({"content": lp.chat_entries(self.tok, trailing), "refusal": None}
                                  if self.chat else lp.legacy_logprobs(self.tok, trailing, at, at))
        return [Frame(self._chunk([choice], coda=ext), id=fid)]

    def _delta_choice(self, index: int, ev: StreamEvent) -> dict[str, Any]:
        text = ev.text
        if self.chat:
            logprobs = ({"content": lp.chat_entries(self.tok, ev.tokens), "refusal": None}
                        if self.logprobs else None)
            return {"index": index, "delta": {"content": text}, "logprobs": logprobs,
                    "finish_reason": None}
        start = self.offsets[index]
        self.offsets[index] += len(text)
        legacy = (lp.legacy_logprobs(self.tok, ev.tokens, start, self.offsets[index])
                  if self.logprobs else None)
        return {"index": index, "text": text, "logprobs": legacy, "finish_reason": None}

    def footer(self) -> list[Frame]:
        terminals = [h.stream.terminal for h in self.r.handles]
        fid = position_id([h.stream.last_seq for h in self.r.handles])
        frames = []
        if self.include_usage and all(t is not None for t in terminals):
            done = [t for t in terminals if t is not None]
            frames.append(Frame(self._chunk([], usage=openai_usage(done, self.r.extra["n"])),
                                id=fid))
        frames.append(Frame("[DONE]", id=fid))
        return frames


def _reject_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    if isinstance(body, ChatCompletionRequest):
        if body.tools and body.tool_choice != "none":
            raise InvalidRequestError("tools: tool calling is not supported", field="tools")
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs: requires logprobs=true",
                                      field="top_logprobs")
        return
    if body.echo:
        raise InvalidRequestError("echo: echo=true is not supported", field="echo")
    if body.suffix:
        raise InvalidRequestError("suffix: suffix is not supported", field="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError("best_of: only best_of == n is supported", field="best_of")


def _prompts(st: ServerState, body: ChatCompletionRequest | CompletionRequest
             ) -> list[list[int]]:
    engine = st.engine
    if isinstance(body, ChatCompletionRequest):
        text = render_chat(engine, body.messages, add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message)
        return [encode(engine, text, add_special_tokens=False)]
    p = body.prompt
    if isinstance(p, str):
        return [encode(engine, p, add_special_tokens=True)]
    if not p:
        raise InvalidRequestError("prompt: must not be empty", field="prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    out = []
    for item in p:
        out.append(encode(engine, item, add_special_tokens=True) if isinstance(item, str)
                   else list(item))  # type: ignore[arg-type]
    return out


async def _handle(request: Request, body: ChatCompletionRequest | CompletionRequest) -> Response:
    st = state_of(request)
    st.check_model(body.model)
    _reject_unsupported(body)
    chat = isinstance(body, ChatCompletionRequest)
    rid = new_id("chatcmpl-" if chat else "cmpl-")
    if chat:
        max_tokens = body.max_completion_tokens or body.max_tokens
        mt_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        max_tokens, mt_field, logprobs = body.max_tokens, "max_tokens", body.logprobs
    knobs = Knobs(max_tokens=max_tokens, max_tokens_field=mt_field,
                  prompt_field="messages" if chat else "prompt", stop=body.stop, n=body.n,
                  seed=body.seed, temperature=body.temperature, top_p=body.top_p,
                  presence_penalty=body.presence_penalty,
                  frequency_penalty=body.frequency_penalty, logit_bias=body.logit_bias,
                  logprobs=logprobs, logprobs_field="top_logprobs" if chat else "logprobs")
    prompts = _prompts(st, body)
    requests = []
    for k, ids in enumerate(prompts):
        sub_id = rid if len(prompts) == 1 else f"{rid}-p{k}"
        requests += build_requests(body, knobs, ids, request_id=sub_id,
                                   default_max_tokens=st.engine_config.default_max_tokens,
                                   context_length=st.engine.context_length,
                                   backpressure=st.settings.backpressure)
    handles = st.submit_all(requests, rename_map(knobs))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    tok = st.engine.tokenizer
    record = Record(rid, "chat" if chat else "completion", handles, now(), st.engine.model_name,
                    make_renderer=lambda after: OpenAIRenderer(
                        record, tokenizer=tok, include_usage=include_usage,
                        logprobs=logprobs is not None, after=after),
                    extra={"n": body.n, "include_usage": include_usage,  # NOTE: extras rebuild
                           "logprobs": logprobs is not None})  # the renderer on any ingress
    st.store.put(record)
    terminals = await stream_or_wait(request, st, record, stream=body.stream,
                                     policy=body.on_disconnect or st.settings.on_disconnect,
                                     headers={"x-request-id": rid})
    if isinstance(terminals, Response):
        return terminals
    return JSONResponse(_final_object(record, terminals, tok, logprobs is not None),
                        headers={"x-request-id": rid})


def _final_object(record: Record, terminals: list[Terminal], tok: Any,
                  with_logprobs: bool) -> dict[str, Any]:
    failed = [t for t in terminals if is_model_failure(t)]
    if failed:
        t = failed[0]
        raise ApiError(500, t.error_message or "model error",
                       code=t.error_code.value if t.error_code else "model_error")
    chat = record.kind == "chat"
    choices = []
    for i, h in enumerate(record.handles):
        c = collect(h.stream)
        reason = openai_finish_reason(c.terminal.finish_reason)
        ext = coda_extension(c.terminal)
        if chat:
            logprobs = ({"content": lp.chat_entries(tok, [t for _, ts in c.deltas for t in ts]),
                         "refusal": None} if with_logprobs else None)
            choices.append({"index": i, "message": {"role": "assistant", "content": c.text},
                            "logprobs": logprobs, "finish_reason": reason, "coda": ext})
        else:
            legacy = None
            if with_logprobs:
                parts, pos = [], 0
                for text, toks in c.deltas:
                    parts.append(lp.legacy_logprobs(tok, toks, pos, pos + len(text)))
                    pos += len(text)
                legacy = lp.merge_legacy(parts)
            choices.append({"index": i, "text": c.text, "logprobs": legacy,
                            "finish_reason": reason, "coda": ext})
    return {"id": record.id, "object": "chat.completion" if chat else "text_completion",
            "created": record.created, "model": record.model, "choices": choices,
            "usage": openai_usage(terminals, record.extra["n"])}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI chat completions (streaming and not) with the Coda extensions."""
    return await _handle(request, body)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI legacy completions (prompt text or token ids, legacy logprobs)."""
    return await _handle(request, body)
