"""A tool result must answer a call the conversation made, and a call must be answered (the
API-gaps issue item 3), as the upstream APIs check it, so a result pointing at a call nobody
issued, or a call the conversation moves past unanswered, is a 400 naming the message (P1),
never a prompt the model is asked to make sense of:

- OpenAI Chat Completions: a ``{"role": "tool"}`` message answers a call of the assistant
  message before it (tool messages follow that message directly, one per call): its
  ``tool_call_id`` must be one of that message's ``tool_calls`` ids; and every id of those
  ``tool_calls`` must have its tool message before the next message of another role.
- Anthropic Messages: a ``tool_result`` block in message *i* answers a ``tool_use`` block of
  message *i - 1*: its ``tool_use_id`` must be one of that message's ``tool_use`` ids; and
  every ``tool_use`` of message *i - 1* must have its ``tool_result`` in message *i*, and the
  results open message *i* (a text block before a result is Anthropic's 400 "Did not find N
  tool_result block(s) at the beginning of this message", naming message *i*).

A conversation that *ends* with the calling message is left alone (nothing follows it yet: the
rule is about what comes next, as the brief of the pairing check states it).
- Responses: a ``function_call_output`` item answers a ``function_call`` item before it (in
  the input or the continued response's history): its ``call_id`` must be one of theirs; and
  every ``function_call`` — of the input, or one the continued response (``previous_response_id``)
  ended with and its history left unanswered — must have its ``function_call_output`` later in
  the input, whatever the order of the outputs. OpenAI applies this one even when the input
  ends with the call (``No tool output found for function call X.``, param ``input``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coda.errors import InvalidRequestError


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def _unanswered(ids: Sequence[object], answered: set[object]) -> list[str]:
    return [str(t) for t in ids if t not in answered]


def _id_string(value: Any, field: str) -> str:
    """A ``tool_use`` block's ``id`` / a ``tool_result``'s ``tool_use_id``: a string, as
    Anthropic types it (missing: ``Field required``)."""
    if isinstance(value, str):
        return value
    raise InvalidRequestError(f"{field}: " + ("Field required" if value is None
                                              else "Input should be a valid string"),
                              field=field)


def check_openai_results(messages: Sequence[Any], field: str = "messages") -> None:
    """Every ``tool`` message answers a call of the assistant message it follows, and every
    call of an assistant message is answered before the next message of another role."""
    issued: set[object] = set()
    calls_at = -1  # NOTE: the last assistant message (whose calls are open), by index
    order: list[object] = []
    answered: set[object] = set()
    for i, m in enumerate(messages):
        role = _get(m, "role")
        if role != "tool":
            missing = _unanswered(order, answered)
            if missing:
                # NOTE: OpenAI names the message that came too early (param ...role)
                raise InvalidRequestError(
                    f"{field}.{i}.role: an assistant message with 'tool_calls' "
                    f"({field}.{calls_at}) must be followed by tool messages responding to "
                    "each 'tool_call_id'. The following tool_call_ids did not have response "
                    f"messages: {', '.join(missing)}", field=f"{field}.{i}.role")
            calls = _get(m, "tool_calls") if role == "assistant" else None
            order = [c.get("id") for c in calls or () if isinstance(c, Mapping)]
            issued, calls_at, answered = set(order), i, set()
            continue
        tid = _get(m, "tool_call_id")
        if not isinstance(tid, str) or not tid:
            raise InvalidRequestError(f"{field}.{i}.tool_call_id: required on a tool message",
                                      field=f"{field}.{i}.tool_call_id")
        if tid not in issued:
            raise InvalidRequestError(
                f"{field}.{i}.tool_call_id: {tid!r} does not answer a tool call of the "
                "preceding assistant message (a tool message must follow the assistant "
                "message whose tool_calls issued its id)", field=f"{field}.{i}.tool_call_id")
        answered.add(tid)


def check_anthropic_results(messages: Sequence[Any], field: str = "messages") -> None:
    """Every ``tool_result`` block answers a ``tool_use`` block of the message before it, and
    every ``tool_use`` block is answered by a ``tool_result`` of the next message."""
    issued: set[object] = set()
    order: list[object] = []
    for i, m in enumerate(messages):
        content = _get(m, "content")
        blocks = content if isinstance(content, list) else []
        kinds = [b.get("type") if isinstance(b, Mapping) else None for b in blocks]
        for j, block in enumerate(blocks):
            if kinds[j] == "tool_use":
                _id_string(block.get("id"), f"{field}.{i}.content.{j}.id")
            if kinds[j] != "tool_result":
                continue
            tid = _id_string(block.get("tool_use_id"), f"{field}.{i}.content.{j}.tool_use_id")
            if tid not in issued:
                # NOTE: Anthropic's words, naming the block (its path said once)
                raise InvalidRequestError(
                    f"{field}.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` "
                    f"blocks: {tid}. Each `tool_result` block must have a corresponding "
                    "`tool_use` block in the previous message.", field=f"{field}.{i}.content.{j}")
        # NOTE: the results open the message: a result after another block (text first) is
        # Anthropic's 400 naming the message, never reordered into a prompt it refuses
        lead = next((j for j, k in enumerate(kinds) if k != "tool_result"), len(kinds))
        if order and "tool_result" in kinds[lead:]:
            raise InvalidRequestError(
                f"{field}.{i}: Did not find {len(order)} tool_result block(s) at the beginning "
                "of this message. Messages following tool_use blocks must begin with a "
                "matching number of tool_result blocks.", field=f"{field}.{i}")
        # NOTE: after the unknown ids (a mistyped id is said as such, not as a missing one)
        results = {b.get("tool_use_id") for b, k in zip(blocks, kinds, strict=True)
                   if k == "tool_result"}
        missing = _unanswered(order, results)
        if missing:
            raise InvalidRequestError(
                f"{field}.{i}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {', '.join(missing)}. Each `tool_use` block must have a "
                "corresponding `tool_result` block in the next message.",
                field=f"{field}.{i}")
        order = [b.get("id") for b in blocks
                 if isinstance(b, Mapping) and b.get("type") == "tool_use"]
        issued = set(order)


def check_responses_results(items: Sequence[Mapping[str, Any]], field: str = "input",
                            history: Sequence[Mapping[str, Any]] = ()) -> None:
    """Every ``function_call_output`` item answers a ``function_call`` made before it (in
    ``history``, the continued response's messages, or earlier in ``items``), and every call
    of ``items``, or left unanswered by ``history``, has its output later in ``items``."""
    issued: set[object] = set()
    open_calls: dict[object, int | None] = {}  # NOTE: unanswered call id -> its item (None: history)
    for m in history:
        for c in m.get("tool_calls") or ():
            if isinstance(c, Mapping):
                issued.add(c.get("id"))
                open_calls[c.get("id")] = None
        if m.get("role") == "tool":
            open_calls.pop(m.get("tool_call_id"), None)
    for i, item in enumerate(items):
        kind = item.get("type")
        if kind == "function_call":
            issued.add(item.get("call_id"))
            open_calls.setdefault(item.get("call_id"), i)
        elif kind == "function_call_output":
            if item.get("call_id") not in issued:
                raise InvalidRequestError(
                    f"{field}.{i}.call_id: no function call found with call_id "
                    f"{item.get('call_id')!r} for this function_call_output",
                    field=f"{field}.{i}.call_id")
            open_calls.pop(item.get("call_id"), None)
    if open_calls:
        cid, at = next(iter(open_calls.items()))  # NOTE: the first in the conversation's order
        # NOTE: OpenAI's words, then where the call is (the field's name keeps them unprefixed)
        where = (f"{field}.{at} is a function_call" if at is not None
                 else "the previous response ended with this function_call")
        raise InvalidRequestError(
            f"No tool output found for function call {cid}. ({where}: {field} must carry a "
            "function_call_output with its call_id after it)", field=field)
