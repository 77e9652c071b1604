"""Stop token-id sequences matched on the selected-id stream (SPEC S1, S3, S4).

:class:`StopTokenMatcher` runs the sparse id automaton of :mod:`coda.stops_automaton`: the
first sequence to end is the hit and absorbing (S3); sequences ending at the same id are
resolved by the S4 tie rule (longest, then configuration order). Across the two kinds
(:mod:`coda.output`, :mod:`coda.output_ids`) an id sequence ending at the same token as a stop
string wins, since ids are checked first (G1). Only a request with ``stop_token_ids`` builds one.
"""

from __future__ import annotations

from collections.abc import Sequence

from coda.errors import InvalidRequestError
from coda.stops import STOP_RULE_VERSION, StopHit, StopMatcherClosed
from coda.stops_automaton import compile_tokens


class StopTokenMatcher:
    """Stop token-id sequences matched on the id stream (S1), S4 tie rule, absorbing hit (S3)."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        seqs: list[tuple[int, ...]] = []
        for seq in sequences:
            ids = tuple(seq)
            if not ids or any(type(t) is not int or t < 0 for t in ids):
                raise InvalidRequestError(
                    "stop token sequences must be non-empty lists of non-negative ids",
                    field="stop_token_ids")
            seqs.append(ids)
        self._seqs = tuple(seqs)
        self._auto = compile_tokens(self._seqs) if seqs else None
        self._state = 0
        self._count = 0
        self._hit: StopHit | None = None

    @property
    def hit(self) -> StopHit | None:
        return self._hit

    @property
    def depth(self) -> int:
        """Length of the current partial match (longest id suffix that is a proper prefix of a
        sequence, so it may still end one)."""
        return self._auto.hold[self._state] if self._auto is not None else 0

    def push(self, token_id: int, armed: bool = True) -> StopHit | None:
        """Consume one selected id; return the hit if a sequence ends here (S4 tie rule).
        ``armed=False`` (before ``min_tokens``, issue 20 D6): a sequence ending here is ignored and
        matching goes on."""
        if self._hit is not None:
            raise StopMatcherClosed("push() after a stop token sequence hit (S3)")
        self._count += 1
        auto = self._auto
        if auto is None:
            return None
        goto, fail = auto.goto, auto.fail
        s = self._state
        while True:  # amortised O(1): each failure step undoes an earlier goto step
            nxt = goto[s].get(token_id)
            if nxt is not None:
                s = nxt
                break
            if s == 0:
                break
            s = fail[s]
        self._state = s
        index = auto.out_index[s]
        if index < 0 or not armed:
            return None
        length = auto.out_len[s]
        self._hit = StopHit("token_ids", index, self._seqs[index], self._count - length,
                            self._count)
        return self._hit

    def snapshot(self) -> dict[str, object]:
        """Matcher state for the request trace (O1)."""
        return {"rule_version": STOP_RULE_VERSION, "state": self._state, "depth": self.depth,
                "tokens": self._count,
                "hit": self._hit.as_dict() if self._hit is not None else None}

