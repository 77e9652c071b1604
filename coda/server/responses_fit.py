"""Responses ``truncation: "auto"`` (OpenAI's meaning; docs/api.md, the ``truncation`` row).

When the conversation (a continued response's history, then the request's ``input``) rendered
by the chat template does not fit the context, by the plan's own rule
(:func:`coda.engine.plan.fits_context`: room after the prompt, and ``max_output_tokens`` within
it), the oldest input items are dropped and the rest rendered again, until it fits. What is never
dropped: the ``instructions`` and every ``system`` / ``developer`` message (kept in place), and
the conversation from its last user message on. A cut starts the kept part at a user message
(whole turns go) and never between a function call and its output (both go, or neither). When
the whole conversation fits, nothing is dropped and "auto" is exactly "disabled"; when even the
shortest cut does not fit, the prompt is the uncut one and the plan refuses it with the very 400
"disabled" gives (``context_length_exceeded``, naming ``input`` or ``max_output_tokens``).

An ``input.truncated`` trace row records a cut (:func:`trace_cut`). Token counts are exact (every candidate is rendered and tokenized); a binary search over the cut
points keeps the renders to about ``2 + log2(turns)``. Entered only with ``truncation: "auto"``
(issue 22: a plain request's walk never imports this module).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coda.engine.plan import fits_context
from coda.errors import ContextLengthExceededError
from coda.trace import INPUT_TRUNCATED, TraceEvent, TraceSink, is_tracing

Message = Mapping[str, Any]
_KEPT_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True)
class Fitted:
    """The prompt's ids and how many input items (messages) the cut dropped (0: uncut)."""

    ids: list[int]
    dropped: int


def _call_ids(msg: Message) -> set[str]:
    return {str(c.get("id")) for c in msg.get("tool_calls") or () if isinstance(c, Mapping)}


def cut_points(conv: Sequence[Message]) -> list[int]:
    """Where the kept part may start (ascending, 0 excluded): a user message such that no call
    before it is answered at or after it (a call and its output go together)."""
    out: list[int] = []
    open_calls: set[str] = set()
    answered_later = [str(m.get("tool_call_id")) for m in conv if m.get("role") == "tool"]
    pending = {c: answered_later.count(c) for c in answered_later}
    for i, msg in enumerate(conv):
        if i and msg.get("role") == "user" and not open_calls:
            out.append(i)
        # NOTE: a call no output answers may go alone (it leaves no output without its call)
        open_calls |= {c for c in _call_ids(msg) if pending.get(c)}
        if msg.get("role") == "tool":
            call = str(msg.get("tool_call_id"))
            pending[call] -= 1
            if pending[call] <= 0:
                open_calls.discard(call)
    return out


def kept(conv: Sequence[Message], cut: int) -> tuple[list[Message], int]:
    """The conversation cut at ``cut`` (system / developer messages before it stay) and the
    number of messages dropped."""
    head = [m for m in conv[:cut] if m.get("role") in _KEPT_ROLES]
    return [*head, *conv[cut:]], cut - len(head)


def fit(render: Callable[[list[Message]], list[int]], instructions: Sequence[Message],
        conv: Sequence[Message], max_tokens: int | None, context_length: int) -> Fitted:
    """The prompt of ``instructions`` + ``conv`` with the fewest oldest items dropped that fits
    (see the module doc). ``render`` turns messages into ids (the chat template, then the
    tokenizer); it may refuse a text too long by its bytes alone (ContextLengthExceededError),
    which counts as not fitting; if no cut fits, that refusal of the uncut prompt is raised, or
    the uncut ids are returned for the plan to refuse."""

    def attempt(cut: int) -> list[int] | None:
        msgs, _ = kept(conv, cut)
        try:
            ids = render([*instructions, *msgs])
        except ContextLengthExceededError:
            return None
        return ids if fits_context(len(ids), max_tokens, context_length) else None

    try:
        whole = render([*instructions, *conv])
    except ContextLengthExceededError as exc:
        whole, refusal = None, exc
    if whole is not None and fits_context(len(whole), max_tokens, context_length):
        return Fitted(whole, 0)  # NOTE: it fits: "auto" is exactly "disabled"
    cuts = cut_points(conv)
    best = attempt(cuts[-1]) if cuts else None
    if best is None:  # NOTE: not even the last turn fits: "disabled"'s own refusal
        if whole is None:
            raise refusal
        return Fitted(whole, 0)
    lo, hi = 0, len(cuts) - 1  # NOTE: invariant: cuts[hi] fits (best holds its ids)
    while lo < hi:
        mid = (lo + hi) // 2
        ids = attempt(cuts[mid])
        if ids is None:
            lo = mid + 1
        else:
            hi, best = mid, ids
    return Fitted(best, kept(conv, cuts[hi])[1])


def trace_cut(sink: TraceSink | None, request_id: str, fitted: Fitted) -> None:
    """An ``input.truncated`` row (``dropped_items``, ``prompt_tokens``) in the request's trace
    when the cut dropped anything: the admission fact the response's ``coda.truncation`` reports
    (docs/api.md). Written before the engine's rows (the request is not submitted yet)."""
    if fitted.dropped and sink is not None and is_tracing(sink):
        sink.record(TraceEvent(request_id, INPUT_TRUNCATED, {
            "dropped_items": fitted.dropped, "prompt_tokens": len(fitted.ids)}))
