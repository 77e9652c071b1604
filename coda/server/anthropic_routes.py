"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: the Anthropic Messages API (issue 4
item 2; SPEC P1–P4, L4–L6). This module reads a request into its prompt and plan (roles,
turns, blocks and tools checked as Anthropic checks them) and answers a whole message; the
stream's events are :mod:`coda.server.anthropic_stream`'s. A final assistant message is a
prefill the model continues.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from coda.engine.plan import check_prompt_room
from coda.errors import ContextLengthExceededError, InvalidRequestError
from coda.finish import Terminal
from coda.server import tools as tl
from coda.server.anthropic_checks import (
    THINKING_OFF,
    check_system_blocks,
    check_thinking_blocks,
    thinking_budget,
    thinking_omitted,
)
from coda.server.anthropic_request import (
    check_output,
    check_pairs,
    check_server_tools,
    check_tool_choice,
    check_unserved,
    merge_turns,
    output_grammar,
)
from coda.server.anthropic_stream import (
    AnthropicRenderer,
    answer_blocks,
    stop_fields,
    usage_of,
    usage_tier,
)
from coda.server.chat import render_chat
from coda.server.common import collect, create, new_id, state_of
from coda.server.http_errors import anthropic_error, api_error_from, failed_json, is_failed
from coda.server.mapping import coda_extension
from coda.server.params import plan_call
from coda.server.protocol_schemas import AnthropicCountRequest, AnthropicMessage, AnthropicRequest
from coda.server.records import Record, register_renderer
from coda.server.render_spec import AnthropicRender
from coda.server.state import ServerState
from coda.server.tool_messages import BLOCK_SEPARATOR, anthropic_history

router = APIRouter()
_ROLES = frozenset({"user", "assistant"})


def _thinking(body: AnthropicRequest) -> tuple[bool, int | None]:
    """Issue 23: ``thinking`` → (show the reasoning, its budget). Absent: shown, no budget
    (the model reasons anyway); ``disabled`` / ``between_tools``: dropped; ``enabled``: shown, ``budget_tokens``
    (Coda's ``max_reasoning_tokens`` too, for one spelling across protocols)."""
    # NOTE: issue 22: without ``thinking`` there is nothing to check: (None, Coda's budget)
    kind, budget = (thinking_budget(body.thinking, body.max_reasoning_tokens, body.max_tokens)
                    if body.thinking is not None else (None, body.max_reasoning_tokens))
    return kind not in THINKING_OFF and body.include_reasoning, budget


def _prewarm(max_tokens: int) -> bool:
    """``max_tokens: 0`` is Anthropic's cache pre-warming (the SDK: "Set to `0` to populate the
    prompt cache without generating a response"): what 0 means on this wire, an answer with
    no content block; the plan admits 0 itself (a prefill, no token). Here, not in
    anthropic_checks: every request asks it, and a plain one never enters that module."""
    return max_tokens == 0


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
        system = body.system
        if isinstance(system, list):  # NOTE: issue 22: a string holds no block
            check_system_blocks(system)
            # NOTE: joined as a turn's text blocks are (tool_messages.BLOCK_SEPARATOR)
            system = BLOCK_SEPARATOR.join(b["text"] for b in system)
        msgs.append({"role": "system", "content": system})
    rendered: list[list[dict[str, Any]]] = []
    for i, m in enumerate(ms):
        if m.role not in _ROLES:
            raise role_error(i, m.role)
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


def role_error(i: int, role: str) -> InvalidRequestError:
    """A message of a role other than ``user`` / ``assistant``: a ``system`` one (Anthropic's
    mid-conversation system message) is refused as Anthropic's models without it refuse it,
    saying where the instructions go instead."""
    if role == "system":
        return InvalidRequestError(
            f"messages.{i}.role: role 'system' is not supported on this model (no "
            "mid-conversation system messages): put the instructions in the top-level "
            "`system` field", field=f"messages.{i}.role")
    return InvalidRequestError(f"messages.{i}.role: must be 'user' or 'assistant', got "
                               f"{role!r}", field=f"messages.{i}.role")


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
    check_tool_choice(body.tool_choice)
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
    """Messages as a :class:`~coda.server.common.Adapter`."""

    kind: Literal["anthropic"] = "anthropic"
    id_prefix = "msg_"
    id_header = "request-id"

    async def parse(self, st: ServerState, body: AnthropicRequest) -> Record:
        st.check_model(body.model)
        if body.container or body.context_management or body.mcp_servers or body.thread:
            check_unserved(body)  # NOTE: a plain request never enters anthropic_request
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
        reasoning = st.reasoning(ids, budget=budget, budget_field="thinking.budget_tokens")
        if _prewarm(body.max_tokens):  # NOTE: nothing is generated: no grammar (checked) to close
            tool.pop("grammar", None)
        spec = AnthropicRender(input_tokens=len(ids), tools=bool(plan and plan.active),
                               verify=body.stream_verify, thinking=reasoning is not None,
                               reasoning=show,  # NOTE: issue 22: no thinking, no check
                               omit_thinking=bool(body.thinking) and thinking_omitted(body.thinking),
                               service_tier="standard" if body.service_tier else None,
                               speed="standard" if body.speed else None,
                               warm=_prewarm(body.max_tokens))
        return plan_call(body, [ids], spec, call_id=new_id(self.id_prefix),
                         kind=self.kind, model=st.engine.model_name,
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
                                "request_id": rid, "id": rid,
                                "content": [{"type": "text", "text": c.text}],
                                "coda": coda_extension(c.terminal)}, c.terminal, headers=headers)
        ext = coda_extension(c.terminal)
        thinking: list[dict[str, Any]] = []
        if c.terminal.reasoning is not None and spec.reasoning:  # NOTE: issue 23
            thinking = [{"type": "thinking", "signature": "",
                         "thinking": "" if spec.omit_thinking else c.reasoning}]
        # NOTE: an empty answer is no block: content [], as Anthropic answers an empty turn and
        # the stream sends it (a split output whose thinking block is sent keeps its text
        # block, as its stream does; with thinking disabled the turn is empty)
        answer: list[dict[str, Any]] = (
            [{"type": "text", "text": c.text}] if c.text or (spec.thinking and spec.reasoning)
            else [])
        calls = 0
        if spec.tools:  # NOTE: blocks in the order generated, as the stream sends them (K2)
            answer, calls, removed = answer_blocks(c.text, rid)
            ext["tool_calls"] = {"count": calls, "removed_bytes": removed}
        # NOTE: the thinking block leads whatever the answer's blocks are (tools included)
        content = thinking + answer
        reason, stop = stop_fields(c.terminal, calls)
        if spec.warm:  # NOTE: max_tokens 0 (cache pre-warming): no block at all
            content = []
        return JSONResponse({"id": rid, "type": "message", "role": "assistant",
                             "model": record.model, "content": content,
                             "stop_reason": reason, "stop_sequence": stop,
                             "diagnostics": None,
                             "usage": {**usage_of(c.terminal, spec.input_tokens),
                                       **usage_tier(spec)},
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
    plan = tool_plan(body)
    if body.output_config is not None or body.output_format is not None:
        check_output(body.output_config, body.output_format, bool(plan and plan.active))
    ids = await asyncio.to_thread(_prompt_ids, st, body, plan)
    # NOTE: as Anthropic: a prompt over the context is no count but the create's 400
    # ("prompt is too long"), named as /v1/messages names it
    try:
        check_prompt_room(len(ids), st.engine.context_length)
    except ContextLengthExceededError as exc:
        raise api_error_from(exc, {"prompt": "messages"}) from None
    return JSONResponse({"input_tokens": len(ids)})
