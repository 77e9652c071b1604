"""The trace checker's output rules: stop.state, stream.delta, stop.hit and a dropped tail in
their place, the stop matcher's holds and the bytes sent (SPEC S1–S4, K2, K3, P2, C2, G1).
Used by :mod:`coda.trace_check` on its per-request :class:`~coda.trace_rules.Request`."""

from __future__ import annotations

from coda import trace as tr
from coda.trace_rules import KNOWN_STOP_RULE_VERSIONS, Request


def in_emission(r: Request, what: str) -> bool:
    """Output rows belong to a token's step or to the drain before the releases."""
    draining = r.state == "DRAINING" and not r.released_order
    if not (r.step_open and r.state == "DECODING") and not draining:
        r.bad("G1", f"{what} outside a token's step and the drain (state {r.state})")
        return False
    if r.cancel_observed:
        r.bad("C2", f"{what} after the cancel was observed")
    return True


def on_stop_state(r: Request, ev: tr.TraceEvent) -> None:
    in_emission(r, "stop.state")
    prev = r.prev_row()
    first = prev is not None and (prev.kind == tr.TOKEN_SELECTED or (
        prev.kind == tr.LIFECYCLE and prev.data.get("to") == "DRAINING") or (
        prev.kind == tr.STOP_STATE and prev.data.get("stops_off")))
    if not first:
        r.bad("G1", "stop.state not at the start of a token's matching")
    nbytes, held = ev.data.get("nbytes"), ev.data.get("held")
    if not isinstance(held, int) or held < 0:
        r.bad("S2", f"held {held!r} is not a byte count")
        return
    if ev.data.get("stops_off"):
        if held != 0:
            r.bad("S2", "the matcher holds bytes after stop strings were switched off")
        return
    r.last_state = ev
    discarded = ev.data.get("discarded")
    if isinstance(discarded, int) and discarded > 0:
        # NOTE: S1: an id sequence's own bytes, pushed while it was a partial match, are
        # dropped at its hit; the bytes drained after it continue at the sequence's start
        r.pushed -= discarded
        while r.token_starts and r.token_starts[-1] >= r.pushed:
            r.token_starts.pop()  # NOTE: L6: the sequence's tokens are never returned
        before = ev.data.get("held_before")
        r.last_held = before if isinstance(before, int) else r.last_held
    r.held_before, r.last_held = r.last_held, held
    if isinstance(nbytes, int):
        if nbytes <= 0:
            r.bad("K2", "stop.state for a token that added no bytes")
        # NOTE: L6: ``starts`` tokens have their first byte in these bytes (a token whose
        # bytes were all held starts with the output that releases them); a row without it
        # is one token's in a step, none at the drain
        starts = ev.data.get("starts", 1 if r.state == "DECODING" else 0)
        if not isinstance(starts, int) or starts < 0:
            r.bad("L6", f"stop.state starts {starts!r} is not a token count")
        else:
            r.token_starts.extend([r.pushed] * starts)
            if len(r.token_starts) > r.selected:
                r.bad("L6", f"{len(r.token_starts)} tokens started, {r.selected} selected")
        r.pushed += nbytes
        if ev.data.get("ids_held") == 0:
            r.held_check = (held, r.pushed)


def close_step(r: Request, by: str | None = None) -> None:
    """At the first row after a step's output: the unsent bytes are the held ones (S2),
    unless the step failed (``by`` a release: a delta that overflowed was never sent)."""
    if r.held_check is not None and r.hit is None and by != tr.RESOURCE_RELEASED:
        held, pushed = r.held_check
        if pushed - r.sent - r.removed != held:
            r.bad("S2", f"{pushed - r.sent - r.removed} bytes unsent but the stop matcher held "
                           f"{held}")
    r.held_check = None
    r.step_open = False


def on_delta(r: Request, ev: tr.TraceEvent) -> None:
    in_emission(r, "stream.delta")
    if r.hit is not None:
        r.bad("S3", "a delta after the stop hit")
    prev = r.prev_kind()
    if prev not in (tr.STOP_STATE, tr.TOKEN_SELECTED, tr.REASONING_SPLIT) and \
            r.state != "DRAINING":
        r.bad("G1", f"stream.delta after {prev}")
    seq, nbytes, text = ev.data.get("seq"), ev.data.get("nbytes"), ev.data.get("text")
    if isinstance(seq, int) and seq <= r.seq:
        r.bad("P2", f"sequence number {seq} not greater than {r.seq}")
    elif seq != r.seq + 1:
        r.bad("P2", f"sequence number {seq!r} leaves a gap after {r.seq}")
    r.seq = seq if isinstance(seq, int) else r.seq + 1
    if not isinstance(text, str) or not isinstance(nbytes, int) or nbytes <= 0 or \
            len(text.encode("utf-8")) != nbytes:
        r.bad("P2", f"delta of {nbytes!r} bytes carries {text!r}")
    else:
        if ev.data.get("reasoning"):
            if r.sent != r.reasoning_sent:
                r.bad("K2", "a reasoning delta after the answer began")
            r.reasoning_sent += nbytes
        r.sent += nbytes
        r.text.append(text)
    if r.sent > r.pushed and r.pushed_known:
        r.bad("K2", f"{r.sent} bytes sent, the detokenizer produced {r.pushed}")


def on_reasoning_split(r: Request, ev: tr.TraceEvent) -> None:
    """Issue 23 (K2): a reasoning marker of ``removed`` bytes is a removed span: pushed,
    never sent, never held."""
    in_emission(r, "reasoning.split")
    removed = ev.data.get("removed")
    if not isinstance(removed, int) or removed <= 0:
        r.bad("K2", f"reasoning.split removed {removed!r} bytes")
        return
    r.removed += removed
    if r.removed > r.pushed:
        r.bad("K2", f"{r.removed} marker bytes removed, the detokenizer produced {r.pushed}")


def on_hit(r: Request, ev: tr.TraceEvent) -> None:
    if r.hit is not None:
        r.bad("S3", "a second stop hit")
    r.hit = ev
    in_emission(r, "stop.hit")
    which = ev.data.get("which")
    prev = r.prev_kind()
    ok_prev = {"string": (tr.STOP_STATE, tr.STREAM_DELTA),
               "token_ids": (tr.TOKEN_SELECTED, tr.STREAM_DELTA)}.get(str(which))
    if ok_prev is None or prev not in ok_prev or (which == "token_ids" and r.state != "DECODING"):
        r.bad("S1", f"a {which!r} stop hit after {prev}")
    if which == "token_ids":
        _check_id_hit(r, ev)
    elif which == "string":
        _check_string_hit(r, ev)
    nxt = r.next_row()
    ends = nxt is not None and (
        (nxt.kind == tr.LIFECYCLE and nxt.data.get("to") == "DRAINING")
        or (nxt.kind == tr.RESOURCE_RELEASED and r.state == "DRAINING"))
    if not ends:
        r.bad("S3", "the stop hit does not end the request at once")
    if ev.data.get("stop_rule_version") not in KNOWN_STOP_RULE_VERSIONS:
        r.bad("S4", f"unknown or missing stop_rule_version "
                       f"{ev.data.get('stop_rule_version')!r}")


def _check_string_hit(r: Request, ev: tr.TraceEvent) -> None:
    """S3: the matcher closes on the hit (nothing held), and the stop ends inside the bytes
    this push added or the ones the previous push left held (a possible tool-call tag start
    waits unmatched until the tag is ruled out): the first match, not one complete before."""
    st = r.last_state
    if st is None or "nbytes" not in st.data:
        return
    if st.data.get("held") != 0:
        r.bad("S3", f"the matcher still holds {st.data.get('held')!r} bytes at its hit")
    offset, nbytes = ev.data.get("byte_offset"), st.data.get("nbytes")
    end = offset + len(str(ev.data.get("stop")).encode("utf-8")) \
        if isinstance(offset, int) else -1
    if isinstance(nbytes, int) and not r.pushed - nbytes - r.held_before < end <= r.pushed:
        r.bad("S3", f"stop ending at byte {end} is not in this push "
                       f"({r.pushed - nbytes}..{r.pushed})")


def _check_id_hit(r: Request, ev: tr.TraceEvent) -> None:
    """S1: an id-sequence hit is the last selected ids, starting at its ``byte_offset``
    (for ids, the index of the sequence's first token)."""
    ids = [e.data.get("token_id") for e in r.rows[:r.i] if e.kind == tr.TOKEN_SELECTED]
    offset = ev.data.get("byte_offset")
    k = r.selected - offset if isinstance(offset, int) else 0
    if not 0 < k <= len(ids) or ev.data.get("stop") != str(tuple(ids[-k:])):
        r.bad("S1", f"stop ids {ev.data.get('stop')!r} at token {offset!r} are not the "
                       f"last selected ids")


def on_tail_dropped(r: Request, ev: tr.TraceEvent) -> None:
    if r.tail is not None:
        r.bad("K3", "a second dropped tail")
    r.tail = ev
    if r.state != "DRAINING" or r.prev_transition_to() != "DRAINING":
        r.bad("K3", "utf8_tail.dropped outside the drain's finish()")
    hexed, nbytes = ev.data.get("hex"), ev.data.get("nbytes")
    try:
        raw = bytes.fromhex(str(hexed))
    except ValueError:
        raw = b""
    if not raw or len(raw) != nbytes:
        r.bad("K3", f"dropped tail {hexed!r} is not {nbytes!r} bytes")
    elif _decodes(raw):
        r.bad("K3", "the dropped tail is valid text: nothing had to be dropped")


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
