"""Exact finish reasons → each protocol's closest value, plus the ``coda`` extension object
that always carries the exact one (SPEC L4, L5, L6, P5; issue 4 item 3).

Closest values: a natural end (eos, stop sequence, grammar, a confidence early stop) is OpenAI
``stop`` / Anthropic ``end_turn`` or ``stop_sequence``; every truncation (length, context,
deadline, cancel, transport) is ``length`` / ``max_tokens``; a policy interruption is
``content_filter`` / ``refusal``. A client disconnect is never reported as a natural end (L5):
its closest value is a truncation and the exact reason ``transport_error`` is in ``coda``.
A FAILED request is shown failed by its state, in each protocol's idiom
(:mod:`coda.server.http_errors`), whatever its reason.
"""

from __future__ import annotations

from typing import Any

from coda.finish import FinishReason, Terminal
from coda.lifecycle import State

F = FinishReason
# NOTE: a confidence early stop (D6) ends CANCELLED but reads as a normal end on the wire: the
# client asked for it; state and exact reason are in ``coda``. grammar_forced_close is a natural
# end too (valid output, issue 13): the SDKs' parse() raises on "length", which would defeat
# closing within the budget.
_NATURAL = frozenset({F.EOS, F.STOP_SEQUENCE, F.GRAMMAR_COMPLETE, F.CONFIDENCE_STOP,
                      F.GRAMMAR_FORCED_CLOSE})


def openai_finish_reason(reason: FinishReason) -> str:
    if reason in _NATURAL:
        return "stop"
    if reason is F.CONTENT_INTERRUPTED:
        return "content_filter"
    return "length"


def anthropic_stop_reason(reason: FinishReason) -> str:
    if reason is F.STOP_SEQUENCE:
        return "stop_sequence"
    if reason in _NATURAL:
        return "end_turn"
    if reason is F.CONTENT_INTERRUPTED:
        return "refusal"
    return "max_tokens"


def responses_status(terminal: Terminal) -> tuple[str, str]:
    """``(final event type, response.status)`` for a Responses stream (exactly one final).
    A FAILED request is ``failed`` whatever its reason (K3 keeps the loop's reason)."""
    reason = terminal.finish_reason
    if terminal.state is State.FAILED or reason is F.MODEL_ERROR:
        return "response.failed", "failed"
    if reason in _NATURAL:
        return "response.completed", "completed"
    if reason is F.CANCELLED:
        return "response.incomplete", "cancelled"
    return "response.incomplete", "incomplete"


def responses_incomplete_reason(reason: FinishReason) -> str:
    """An incomplete response's ``incomplete_details.reason``: one of OpenAI's values (the
    SDK's type is a closed literal), so every truncation (length, context, deadline,
    transport) is ``max_output_tokens``, as chat's is ``length``; the exact reason is in
    ``coda``. A cancelled response has none (status ``cancelled``, as OpenAI's)."""
    if reason is F.CONTENT_INTERRUPTED:
        return "content_filter"
    return "max_output_tokens"


def matched_stop(terminal: Terminal) -> str | list[int] | None:
    if terminal.stop is None:
        return None
    stop = terminal.stop.stop
    return stop if isinstance(stop, str) else list(stop)


def coda_extension(terminal: Terminal, network_send_s: float | None = None) -> dict[str, Any]:
    """The exact outcome of one request: the ``coda`` object on final chunks and objects."""
    timings: dict[str, Any] = dict(terminal.timings())
    if network_send_s is not None:
        timings["network_send_s"] = network_send_s
    out: dict[str, Any] = {
        "finish_reason": terminal.finish_reason.value,
        "state": terminal.state.value,
        "model_snapshot": terminal.model_snapshot,
        "matched_stop": matched_stop(terminal),
        "usage": terminal.usage.to_dict(),
        "timings": timings,
        # L4, S4: the finish-reason enum and stop tie rule this outcome was decided under
        "versions": {"finish_reason": terminal.finish_reason_version,
                     "stop_rule": terminal.stop_rule_version},
    }
    if terminal.early_stop is not None:
        out["early_stop"] = dict(terminal.early_stop)
    if terminal.dropped_tail:  # K2: what utf8_tail="drop" removed, recorded
        out["utf8_tail_dropped"] = {"bytes": len(terminal.dropped_tail),
                                    "hex": terminal.dropped_tail.hex()}
    if terminal.error_code is not None:
        out["error"] = {"code": terminal.error_code.value, "message": terminal.error_message}
    if terminal.reasoning is not None:
        out["reasoning"] = reasoning_record(terminal)
    if terminal.speculative is not None:  # issue 21: what speculation drafted and kept
        out["speculative"] = dict(terminal.speculative)
    return out


def reasoning_record(terminal: Terminal) -> dict[str, Any] | None:
    """Issue 23, K2: the split as the wire records it: the removed markers, the reasoning's
    byte count (the stream's first ``bytes`` bytes are reasoning), forced by the budget."""
    r = terminal.reasoning
    if r is None:
        return None
    return {"opener": r.opener.decode("utf-8", "replace"), "bytes": r.reasoning_bytes,
            "closer": r.closer.decode("utf-8", "replace"), "closed": bool(r.closer),
            "forced": r.forced, "tokens": r.reasoning_tokens}


def openai_usage(terminals: list[Terminal], n: int = 1) -> dict[str, Any]:
    """OpenAI usage over prompts × n choices (each prompt's n choices consecutive): every
    prompt counted once, completion = selected (billed) tokens of every choice."""
    firsts = terminals[::max(n, 1)]
    prompt = sum(t.usage.prompt_tokens for t in firsts)
    cached = sum(t.usage.cached_prompt_tokens for t in firsts)
    completion = sum(t.usage.selected_tokens for t in terminals)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion,
                           "prompt_tokens_details": {"cached_tokens": cached}}
    if any(t.reasoning is not None for t in terminals):  # NOTE: issue 23
        out["completion_tokens_details"] = {"reasoning_tokens": sum(
            t.reasoning.reasoning_tokens for t in terminals if t.reasoning is not None)}
    return out


def system_fingerprint(model_snapshot: str | None) -> str | None:
    """OpenAI's ``system_fingerprint``: ``fp_`` and the first 10 hex digits of the model's
    content identity (P1: weights, tokenizer, template, serving mode, Coda version), so it
    changes exactly when what produces the output does; None where no identity is known."""
    if not model_snapshot:
        return None
    return "fp_" + model_snapshot.removeprefix("sha256:")[:10]


def prediction_usage(usage: dict[str, Any], terminals: list[Terminal]) -> dict[str, Any]:
    """``usage`` of a request with a ``prediction``: its prediction tokens that the output
    has, in order (``accepted_prediction_tokens``), and the rest (``rejected_...``), as the
    engine counted them (coda.engine.prediction; the same whether or not it drafted)."""
    counts = [t.prediction for t in terminals if t.prediction is not None]
    details = {**usage.get("completion_tokens_details", {}),
               "accepted_prediction_tokens": sum(c["accepted"] for c in counts),
               "rejected_prediction_tokens": sum(c["rejected"] for c in counts)}
    return {**usage, "completion_tokens_details": details}
