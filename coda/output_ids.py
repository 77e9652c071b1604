"""Stop token-id sequences in the processor: the id matcher's holds and an id hit's end
(SPEC S1, S3, S4, K2, K3, L6, G1).

Both stop kinds see every token at once (S1, S4): each id is pushed to the id-sequence
matcher (:func:`push`) and then detokenized, and its bytes go through the string matcher, so
a stop string inside text whose ids might still start an id sequence ends the request at the
token where it completes. What such ids hold back is the *sending* of their bytes: bytes owned
by the last ``depth`` ids (the id matcher's partial match) wait, like bytes that may start a
stop string; per held id the processor keeps a fork of the detokenizer and the string matcher
as they were before it (``_forks``).

Earliest end wins across kinds, counted in selected tokens; an id sequence and a string
completing at the same token: the id sequence wins (it is checked first, G1). On an id hit
(:func:`end_before_ids`) the bytes of every token before the sequence's first id are sent;
the sequence's own text never is. Bytes the detokenizer still held for those tokens (a
byte-fallback run the sequence closed) are drained then and matched by the string matcher as
it stood before the sequence: a stop string they complete ends before the ids and wins (S4).
After a reasoning block the matcher sees the answer's tokens only (issue 23, ``_id_base``).

Functions of :class:`coda.output.OutputProcessor`'s state, called by it only when the request
has stop id sequences: a request without them never runs this module.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import TYPE_CHECKING

from coda import trace as tr
from coda.errors import DecodingError
from coda.stops import StopHit
from coda.stops_ids import StopTokenMatcher

if TYPE_CHECKING:
    from coda.output import OutputProcessor


def push(p: OutputProcessor, matcher: StopTokenMatcher, token_id: int) -> StopHit | None:
    """Push one id (before it is detokenized: ids first, G1). On a hit, the stop that ends the
    output (a string the drained text completes before the ids, S4, or the sequence, with
    token positions counted from the output's start); otherwise keep a fork per held id."""
    hit = matcher.push(token_id, p._armed)
    if hit is not None:  # NOTE: its last id never reaches the detokenizer (ids first)
        earlier = end_before_ids(p, hit.end - hit.start)
        if earlier is not None:  # NOTE: S4: a stop string ending before the ids
            return earlier
        if p._id_base:  # NOTE: issue 23: the matcher saw the answer's tokens only
            hit = replace(hit, start=hit.start + p._id_base, end=hit.end + p._id_base)
        return hit
    depth = matcher.depth
    if depth:
        p._forks.append((p.detok.fork(), copy.copy(p.stops), p._tag_tail, p._waiting))
        while len(p._forks) > depth:
            p._forks.popleft()
    else:
        p._forks.clear()
    return None


def end_before_ids(p: OutputProcessor, k: int) -> StopHit | None:
    """An id sequence of ``k`` ids hit: send the whole text of the tokens before its first
    id, nothing of its own (S1, S3). ``_ends[-k]`` is the stream offset after the token
    before the sequence (its first k-1 ids were pushed); bytes those tokens left in the
    detokenizer (an open byte-fallback run, a partial character) are drained from its
    state before the sequence's first id: whole characters are sent, a partial last one is
    removed and recorded like a cut tail (K2, K3). The drained bytes are output, so they
    go through the stop-string matcher as it was before the sequence: a string they
    complete ends before the ids and wins (S4, earliest end; no stop string reaches the
    stream): it is returned, and only the text before it is sent."""
    upto = p._ends[-k]
    p._own = k  # NOTE: the sequence's own tokens: never reported (S3)
    discarded = p._sent_off + len(p._stream) - upto
    del p._stream[max(upto - p._sent_off, 0):]  # NOTE: the sequence's own bytes
    # NOTE: L6: the sequence's tokens are never returned (``_unreturned`` counts every
    # detokenized byte; stream offsets start at the answer, issue 23)
    while p._unreturned and p._unreturned[-1] >= upto + p._answer_base:
        p._unreturned.pop()
    # NOTE: the sequence's bytes are gone: what the fork drains below starts at ``upto``
    # (a byte run closed by the sequence's first id was counted from there already)
    p._visible = upto + p._answer_base
    p._token_ends.rewind(p._visible, k)
    det, waiting = p.detok, p._waiting
    if k > 1:
        det, p.stops, p._tag_tail, waiting = p._forks[-(k - 1)]
    residue = det.pending
    try:
        text, cut = det.finish_cut()
    except DecodingError:  # NOTE: bytes no byte could complete: removed as after a hit
        text, cut = b"", residue
    p.detok.discard_pending()
    p._forks.clear()
    p._hit_cut = cut  # NOTE: recorded by the drain, where the trace expects it (K3)
    p._token_ends.output(text)
    p._note_detok_end(0, fallback=not cut)
    hit = None
    if text:
        # NOTE: L6, K2: bytes drained here are output of the tokens before the sequence,
        # visible like a push's (the tokens whose bytes they are, L6)
        p._note_visible(text, waiting)
        p._stream += text
        p._draining = True  # NOTE: no byte follows: a waiting tag start is text
        hit = p._match(text)
        if p._tracing:
            # NOTE: ``discarded``: the sequence's own bytes, pushed while it was a partial
            # match, are gone: the checker's stream offsets go back to its start, where
            # the matcher held ``held_before`` bytes
            rewind = ({"discarded": discarded,
                       "held_before": len(p.stops.held) + len(p._tag_tail)}
                      if discarded else {})
            p._record(tr.STOP_STATE, nbytes=len(text), starts=p._starts, held=0,
                      detok_pending=0, ids_held=0, **rewind)
    p._release(p.stops.emitted_bytes if hit is not None
                  else p._sent_off + len(p._stream))
    return hit
