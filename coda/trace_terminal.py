"""The trace checker's rules on a request's terminal row: what it reports must be what the
rows before it show (SPEC L2, L4, L5, L6, T2, S3, K2, K3, P2, C1, O2 rows 1, 2, 6)."""

from __future__ import annotations

from typing import Any

from coda import trace as tr
from coda.finish import CancelCause
from coda.trace_rules import (
    CANCEL_CAUSES,
    ERROR_CODES,
    FINISHED_REASONS,
    TOKEN_REASONS,
    Request,
    check_versions,
)


def check_terminal(r: Request, ev: tr.TraceEvent) -> None:
    """Run every terminal rule; violations go to ``r.out`` (via ``r.bad``)."""
    for problem in check_versions(ev):
        r.bad(problem.rsplit("(", 1)[-1].rstrip(")"), problem.split(": ", 1)[-1])
    seq = ev.data.get("seq")
    if seq != r.seq + 1:
        r.bad("P2", f"terminal seq {seq!r} not after {r.seq}: a delta is missing or extra")
    state, reason, error = ev.data.get("state"), ev.data.get("reason"), ev.data.get("error")
    if (state == "FAILED") != (error is not None) or (error is not None and
                                                     error not in ERROR_CODES):
        r.bad("L4", f"error {error!r} on a {state} terminal")
    _reason(r, state, reason, error)
    if r.model_run:  # NOTE: a hand-driven run without a processor counts nothing
        _usage(r, ev.data.get("usage"), reason)
    _stops(r, state, reason, ev.data.get("usage"))
    tail = r.tail.data.get("hex") if r.tail is not None else ""
    if ev.data.get("dropped_tail_hex", "") != tail:
        r.bad("K2", f"terminal reports dropped tail {ev.data.get('dropped_tail_hex')!r}, "
                    f"the drain dropped {tail!r}")
    if r.tail is not None and state != "FINISHED":
        r.bad("K3", "a dropped tail on a request that did not finish")


# A FAILED end's reason by its error code (RequestRun.fail and finish's K3 path)
_FAILED_REASONS = {"model_error": frozenset({"model_error"}),
                   "backpressure_overflow": frozenset({"transport_error"}),
                   "decoding_error": FINISHED_REASONS - {"stop_sequence"}}


def _reason(r: Request, state: Any, reason: Any, error: Any) -> None:
    if state == "FINISHED" and reason not in FINISHED_REASONS:
        r.bad("L4", f"FINISHED with reason {reason!r}")
    if state == "FAILED" and reason not in _FAILED_REASONS.get(str(error), {reason}):
        r.bad("L5", f"a {error} failure reported as {reason!r}")
    if state == "CANCELLED":
        cancel = r.cancel_requested
        if cancel is None:
            r.bad("C1", "CANCELLED without a cancel.requested")
        else:
            cause, named = cancel.data.get("cause"), cancel.data.get("reason")
            want = named or (CancelCause(str(cause)).finish_reason.value
                             if cause in CANCEL_CAUSES else None)
            if reason != want:
                r.bad("L5", f"cancel by {cause} reported as {reason}, not {want}")
    if r.drain_at is not None:
        frm = r.rows[r.drain_at].data.get("from")
        if frm in ("QUEUED", "PREFILLING") and reason != "deadline_exceeded":
            r.bad("G3", f"drained from {frm} with reason {reason!r}")
    # T2: decided right after the last token: no decode of it, drained in its step; a
    # prefill-only request (max_tokens 0, prompt scoring) ends right after its prefill instead
    prefill_only = (reason == "max_output_tokens" and r.selected == 0
                    and r.prefill_done is not None)
    if reason in TOKEN_REASONS and r.drain_at is not None and r.model_run and not prefill_only \
            and (not r.drain_after_token or r.drain_selected != r.drain_decoded + 1):
        r.bad("T2", f"{reason} end not decided in the step of the last token")
    if reason == "eos" and r.drain_at is not None and r.last_token_at is not None:
        between = [e.kind for e in r.rows[r.last_token_at + 1:r.drain_at]
                   if e.kind != tr.CANCEL_REQUESTED]
        if between:
            r.bad("S1", f"EOS shown: its step wrote {', '.join(between)}")


def _usage(r: Request, usage: Any, reason: Any) -> None:
    if not isinstance(usage, dict):
        r.bad("L6", "terminal without usage")
        return
    prompt = r.prefill.data.get("tokens") if r.prefill is not None else None
    cached = r.prefill.data.get("cached", 0) if r.prefill is not None else 0
    want: dict[str, Any] = {"selected_tokens": r.selected, "processed_output_tokens": r.decoded,
                            "returned_bytes": r.sent, "cached_prompt_tokens": cached}
    if prompt is not None:
        want["prompt_tokens"] = prompt
        if r.prefill_done is not None:
            want["processed_prompt_tokens"] = prompt - cached
    else:
        want["processed_prompt_tokens"] = 0
    if r.pushed_known:
        want["returned_tokens"] = sum(1 for s in r.token_starts if s < r.sent + r.removed)
    for name, value in want.items():
        if usage.get(name) != value:
            r.bad("L6", f"usage.{name} {usage.get(name)!r}, the rows count {value!r}")
    processed = usage.get("processed_prompt_tokens")
    if prompt is not None and r.prefill_done is None and not (
            isinstance(processed, int) and 0 <= processed <= prompt - cached):
        r.bad("L6", f"usage.processed_prompt_tokens {processed!r} past the prompt")
    returned, selected = usage.get("returned_tokens"), usage.get("selected_tokens")
    if reason == "eos" and isinstance(returned, int) and isinstance(selected, int) and \
            selected and returned >= selected:
        r.bad("O2", "eos terminal but every selected token was returned: EOS shown")
    if isinstance(returned, int) and isinstance(selected, int) and returned > selected:
        r.bad("L6", f"{returned} tokens returned of {selected} selected")


def _stops(r: Request, state: Any, reason: Any, usage: Any) -> None:
    stop_end = state == "FINISHED" and reason == "stop_sequence"
    if (r.hit is not None) != stop_end or (reason == "stop_sequence" and r.hit is None):
        r.bad("S3", f"stop hit {'without' if r.hit is None else 'with'} a stop_sequence end "
                    f"({state} {reason})")
    text = "".join(r.text)
    if r.hit is not None and r.hit.data.get("which") == "string":
        stop = str(r.hit.data.get("stop"))
        offset = r.hit.data.get("byte_offset")
        # NOTE: include_stop_str_in_output may end the text with it, never show it earlier;
        # an occurrence completed in the bytes before ``armed_at`` (min_tokens, issue 20 D6) is text
        # NOTE: issue 23: stops see the answer only (bytes after the reasoning deltas), and
        # the hit's offset counts the removed reasoning markers too
        sent, pat = text.encode()[r.reasoning_sent:], stop.encode()
        at = max(0, int(r.hit.data.get("armed_at", 0)) - len(pat) + 1)
        if 0 <= sent.find(pat, at) < len(sent) - len(pat):
            r.bad("O2", f"stop string {stop!r} reached the stream before its hit")
        upto = r.sent + r.removed
        shown = text.endswith(stop) and offset == upto - len(stop.encode("utf-8"))
        if offset != upto and not shown:
            r.bad("S3", f"stop hit at byte {offset!r} but {upto} bytes were sent or removed")
    if state == "FINISHED" and r.hit is None and r.pushed_known and \
            r.pushed != r.sent + r.removed:
        r.bad("K2", f"a normal end sent {r.sent} of the {r.pushed} bytes produced")
