"""The compiled stop sets: Aho–Corasick automata over bytes and over token ids (SPEC S1, S2, S4).

Both matchers (:class:`coda.stops.StopStringMatcher` on the visible bytes,
:class:`coda.stops_ids.StopTokenMatcher` on the selected ids) run one of these automata,
compiled once per stop set and shared by every request with the same stops (``lru_cache``).

The byte automaton has a dense transition table (one 256-entry row per state), so a byte costs
one list lookup and one comparison whatever the number of stops or the output length. A state
is the longest suffix of the output that is a prefix of some stop, so **the state depth is the
held-back length** (S2). Every stop ending at a state is a suffix of the state's string, so the
longest one (S4's second key) is the state itself or the first terminal on its failure chain,
precomputed per state; duplicates keep the lowest configuration index (S4's third key).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class _Trie:
    """Aho–Corasick skeleton shared by both matchers (sequences of ints: bytes or token ids)."""

    goto: list[dict[int, int]]  # trie edges
    depth: list[int]
    fail: list[int]  # longest proper suffix that is a trie node
    out: list[int]  # config index of the longest stop that is a suffix of the node, else -1
    order: list[int]  # non-root nodes in BFS order (a node's failure target comes earlier)
    hold: list[int]  # length of the longest suffix of the node that is a proper stop prefix


def _build_trie(seqs: Sequence[Sequence[int]]) -> _Trie:
    goto: list[dict[int, int]] = [{}]
    depth = [0]
    term = [-1]  # lowest config index of a stop equal to this node's string
    for idx, seq in enumerate(seqs):
        node = 0
        for sym in seq:
            nxt = goto[node].get(sym)
            if nxt is None:
                nxt = len(goto)
                goto[node][sym] = nxt
                goto.append({})
                depth.append(depth[node] + 1)
                term.append(-1)
            node = nxt
        if term[node] < 0:
            term[node] = idx  # NOTE: duplicates keep the first index (config-order tie, S4)
    fail = [0] * len(goto)
    out = [-1] * len(goto)
    order: list[int] = []
    queue = deque(goto[0].values())
    while queue:  # BFS: fail[node] is shallower, so out[fail[node]] is already final
        node = queue.popleft()
        order.append(node)
        # NOTE: the node's own stop is the longest suffix stop; else inherit along the fail link.
        out[node] = term[node] if term[node] >= 0 else out[fail[node]]
        for sym, child in goto[node].items():
            f = fail[node]
            while f and sym not in goto[f]:
                f = fail[f]
            fail[child] = goto[f].get(sym, 0) if node else 0
            queue.append(child)
    # NOTE: a node with children is a proper prefix of a stop; a leaf (a whole stop that no
    # longer stop extends) holds only what its failure chain can still extend (min_tokens).
    hold = [0] * len(goto)
    for node in order:
        hold[node] = depth[node] if goto[node] else hold[fail[node]]
    return _Trie(goto, depth, fail, out, order, hold)


class ByteAutomaton:
    """Immutable compiled stop set, shared by every matcher with the same stops.

    States are renumbered so that live states (no stop ends there) are ``0 .. n_live-1`` and hit
    states are ``n_live ..``; the hot loop then needs a single ``>=`` to detect a hit, and hit
    states need no transition row at all.
    """

    __slots__ = ("delta", "depth", "hit_delta", "hit_hold", "hit_index", "hit_len", "n_live",
                 "start_search")

    def __init__(self, stops: tuple[bytes, ...]) -> None:
        trie = _build_trie(stops)
        goto, depth, fail, out, order = trie.goto, trie.depth, trie.fail, trie.out, trie.order
        n = len(goto)
        # Renumber: root, live nodes in BFS order, then hit nodes.
        live = [0] + [x for x in order if out[x] < 0]
        hits = [x for x in order if out[x] >= 0]
        new_id = [0] * n
        for i, x in enumerate(live + hits):
            new_id[x] = i
        self.n_live = len(live)
        self.depth = [depth[x] for x in live]
        self.hit_len = [len(stops[out[x]]) for x in hits]
        self.hit_index = [out[x] for x in hits]
        # NOTE: BFS order: a node's failure target (shallower) has its row already.
        rows: list[list[int]] = [[]] * n
        for x in [0, *order]:
            row = list(rows[new_id[fail[x]]]) if x else [0] * 256
            for b, child in goto[x].items():
                row[b] = new_id[child]
            rows[new_id[x]] = row
        self.delta = rows[: self.n_live]
        # Hit states go on only while a hit must be ignored (before min_tokens, issue 20 D6).
        self.hit_delta = rows[self.n_live:]
        self.hit_hold = [trie.hold[x] for x in hits]
        # NOTE: only built for a non-empty stop set, so the regex character class is non-empty.
        starts = b"".join(re.escape(bytes([b])) for b in sorted(goto[0]))
        self.start_search = re.compile(b"[" + starts + b"]").search


@lru_cache(maxsize=128)
def compile_bytes(stops: tuple[bytes, ...]) -> ByteAutomaton:
    return ByteAutomaton(stops)



class TokenAutomaton:
    """Aho–Corasick over token ids with sparse goto (vocabularies are large) and failure links."""

    __slots__ = ("fail", "goto", "hold", "out_index", "out_len")

    def __init__(self, seqs: tuple[tuple[int, ...], ...]) -> None:
        trie = _build_trie(seqs)
        self.goto = trie.goto
        self.hold = trie.hold
        self.fail = trie.fail
        self.out_index = trie.out
        self.out_len = [len(seqs[i]) if i >= 0 else 0 for i in trie.out]


@lru_cache(maxsize=128)
def compile_tokens(seqs: tuple[tuple[int, ...], ...]) -> TokenAutomaton:
    return TokenAutomaton(seqs)


