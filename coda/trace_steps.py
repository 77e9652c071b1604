"""The trace checker's step rules (SPEC T1, T2, G1, L1, C1, C3, S3, D5, L6, O1): a request's
prefill, each token's choice (``token.selected`` t = 1, 2, ... only while DECODING, at a step's
choose, when every earlier token was decoded, never after a cancel was observed or a stop hit),
the decode of the last selected token (cache length = prompt + t), a speculative verification's
counts, a forced grammar close, and a model error row in its step with its D5 decision. Used
by :mod:`coda.trace_check` (the walk, which documents the rules as a whole) on its per-request
:class:`~coda.trace_rules.Request`.
"""

from __future__ import annotations

from coda import trace as tr
from coda.trace_rules import FAILURE_DECISIONS, Request, check_verify_row


def on_prefill_started(r: Request, ev: tr.TraceEvent) -> None:
    if r.prefill is not None:
        r.bad("T1", "a second prefill.started")
    r.prefill = ev
    if r.prev_transition_to() != "PREFILLING":
        r.bad("L1", "prefill.started not at the PREFILLING transition")


def on_prefill_completed(r: Request, ev: tr.TraceEvent) -> None:
    r.reach_safe_point()
    if r.prefill_done is not None:
        r.bad("T1", "a second prefill.completed")
    r.prefill_done = ev
    if r.prev_transition_to() != "DECODING":
        r.bad("T1", "prefill.completed not at the DECODING transition")
    if r.prefill is not None and ev.data.get("cache_len") != r.prefill.data.get("tokens"):
        r.bad("T1", f"prefill cache length {ev.data.get('cache_len')} is not the prompt's "
                    f"{r.prefill.data.get('tokens')}")


def on_grammar_forced_close(r: Request, ev: tr.TraceEvent) -> None:
    nxt = r.next_row()
    if r.state != "DECODING" or nxt is None or nxt.kind != tr.TOKEN_SELECTED:
        r.bad("G1", "grammar.forced_close not directly before the token it replaced")
    elif ev.data.get("path_tokens") and nxt.data.get("token_id") == ev.data.get("rejected"):
        r.bad("G1", "the forced token is the one the closing path rejected")


def on_token_selected(r: Request, ev: tr.TraceEvent) -> None:
    t = ev.data.get("t")
    if r.cancel_seen_at_safe_point:
        r.bad("C1", "a cancel requested before this step's safe point, yet a token was "
                    "selected (G1: cancel is checked before choose)")
    if r.cancel_observed:
        r.bad("C3", "token selected after cancel was observed")
    if r.hit is not None:
        r.bad("S3", "token selected after the stop hit")
    if r.state != "DECODING":
        r.bad("G1", f"token selected while {r.state}")
    if r.selected != r.decoded:
        r.bad("T1", f"token {t} selected before token {r.selected} was decoded")
    prev = r.prev_kind()
    if prev not in (tr.PREFILL_COMPLETED, tr.DECODE_COMPLETED, tr.GRAMMAR_FORCED):
        r.bad("G1", f"token selected after {prev} (not at a step's choose)")
    r.selected += 1
    if t != r.selected:
        r.bad("T1", f"token.selected t={t}, expected {r.selected}")
    decision = ev.data.get("decision")
    if isinstance(decision, dict) and "token_id" in decision and \
            decision["token_id"] != ev.data.get("token_id"):
        r.bad("O1", "token_id differs from its decision record's")
    r.last_token_at = r.i
    r.step_open = True
    r.last_state = None


def on_decode_started(r: Request, ev: tr.TraceEvent) -> None:
    if r.state != "DECODING" or r.cancel_observed:
        r.bad("T2", f"decode.started while {r.state}")
    if r.selected != r.decoded + 1 or ev.data.get("t") != r.selected:
        r.bad("T1", f"decode.started t={ev.data.get('t')} with {r.selected} selected, "
                    f"{r.decoded} decoded")
    # NOTE: a forward that raised in the reference loop fails the run at once
    if r.next_kind() not in (tr.DECODE_COMPLETED, tr.ERROR, tr.RESOURCE_RELEASED):
        r.bad("T1", "decode.started without its decode.completed")
    r.decode_open = ev


def on_decode_completed(r: Request, ev: tr.TraceEvent) -> None:
    r.reach_safe_point()
    started, r.decode_open = r.decode_open, None
    if started is None or started.data.get("t") != ev.data.get("t"):
        r.bad("T1", f"decode.completed t={ev.data.get('t')} without its decode.started")
    r.decoded += 1
    if r.decoded > r.selected:
        r.bad("T1", f"decoded {r.decoded} exceeds selected {r.selected}")
    prompt = r.prefill.data.get("tokens") if r.prefill is not None else None
    if isinstance(prompt, int) and ev.data.get("cache_len") != prompt + r.decoded:
        r.bad("T1", f"cache length {ev.data.get('cache_len')} after decoding token "
                    f"{r.decoded} of a {prompt}-token prompt")


def on_speculative_verify(r: Request, ev: tr.TraceEvent) -> None:
    """Issue 21 (O1): a verification happens while DECODING, at the next token's choose,
    and its counts add up; the row sits right after the forward that verified it."""
    d = ev.data
    check_verify_row(r, ev)
    if r.state != "DECODING" or d.get("t") != r.selected + 1:
        r.bad("O1", f"speculative.verify t={d.get('t')} while {r.state} with "
                    f"{r.selected} selected")
    if d.get("drafted") != (d.get("accepted") or 0) + (d.get("rejected") or 0):
        r.bad("O1", "speculative.verify: drafted != accepted + rejected")


def on_error(r: Request, ev: tr.TraceEvent) -> None:
    if r.state not in ("PREFILLING", "DECODING", "CANCEL_REQUESTED") and \
            not (r.state == "QUEUED" and r.prefill is None):
        r.bad("G1", f"model error row while {r.state}")
    if ev.data.get("committed_tokens") != r.selected:
        r.bad("L6", f"error row commits {ev.data.get('committed_tokens')} tokens, "
                    f"{r.selected} were selected")
    retryable, decision = ev.data.get("retryable"), ev.data.get("decision")
    if decision not in FAILURE_DECISIONS or retryable is not (decision == "retry-allowed"):
        r.bad("D5", f"error row decides {decision!r} with retryable={retryable!r}")
    prev = r.prev_kind()
    # NOTE: a re-prefill after a preemption may fail too (T4)
    if prev not in ((tr.DECODE_STARTED, tr.KV_REACQUIRED) if r.state == "DECODING"
                    else (tr.PREFILL_STARTED, tr.ERROR, tr.KV_REACQUIRED)):
        r.bad("G1", f"model error row after {prev}, not after its step's start")
    # NOTE: a final error fails the request at once (its releases follow); a retried one
    # leaves it running
    if (r.next_kind() == tr.RESOURCE_RELEASED) is bool(retryable):
        r.bad("D5", f"a {'retried' if retryable else 'final'} model error "
                    f"{'ends' if retryable else 'does not end'} the request")
