"""The closing walk: a completion from a grammar state to an accepting one, as tokens (issue 13
item 2; SPEC L4, G1). The budget rule it serves, the invariant and its forcing, is
:mod:`coda.engine.closure`'s.

How "tokens needed" is bounded: :func:`closing_path` walks from the current grammar state to an
accepting one byte by byte, at each step taking the first byte the grammar allows from a
fixed preference order (closing quotes and brackets first, then ``0``, then letters, then
everything else; forced bytes first of all). The walk is a *greedy* completion, not
necessarily the shortest, so its length is an upper bound on what is needed — which is the
direction the invariant needs. The byte path is then tokenized canonically and re-checked
against the grammar; if the grammar rejects that tokenization, the single-byte tokens are
used. The walk only takes bytes the tokenizer spells as one token, so every completion it finds
is realizable and the bound holds for any tokenizer. A tokenizer that spells every byte
(byte-level BPE, byte fallback) can always be walked; one that lacks some bytes (SmolLM2's GGUF
vocabulary has no token for six control bytes, 0xC0, 0xC1, 0xF1, 0xF2) is walked around them —
JSON never needs raw control bytes, and 0xC0/0xC1 never occur in UTF-8. A byte the grammar
lets repeat without end (`^[0-9]+x$` takes `0` forever, an email's local part too) would keep
the greedy walk in a loop: once it has chosen the same byte ``STALL_RUN`` times in a row (a
closing bracket outside text does not count: each one closes a level of nesting), the
run is cut back to one and from then on the walk prefers the bytes it has chosen least (the
fixed order among equals), which leaves every such loop, until it takes a quote (in JSON the
string that looped is closed: the plain order closes the rest, as short as before). None
found from the start turns closure off for the request (:mod:`coda.engine.closure`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # NOTE: llguidance is imported by the first grammar (issue 19 item 2)
    import llguidance as llg

__all__ = ["ByteTable", "ClosingPath", "byte_table", "closing_path"]

# NOTE: preference order of the greedy walk: end what is open, then the smallest values. Inside
# free text (a letter is allowed) a quote comes first: there a bracket would be text, not a close.
# A separator comes before digits: after a number, more digits never bring the end closer.
_STRUCT = b"}]" + b'"' + b",:" + b"0123456789" + b"a" + b"etnrsilofdu" + b"-." + b" {["
_IN_TEXT = b'"' + _STRUCT
# NOTE: then every other byte: a prefix may end inside a UTF-8 character (continuation bytes)
_REST = bytes(range(32, 127)) + bytes(range(0x80, 0xF5)) + bytes(range(32))
_ORDER = list(dict.fromkeys(_STRUCT + _REST))
_ORDER_TEXT = list(dict.fromkeys(_IN_TEXT + _REST))
_PROBE = ord("a")
_QUOTE = ord('"')  # NOTE: in JSON a raw quote byte always opens or closes a string
_CLOSERS = b"]}"  # NOTE: outside text each one closes a level: a run of them is progress
MAX_WALK = 4096  # bytes; a completion longer than this counts as "not closable"
STALL_RUN = 8    # the same byte chosen this many times in a row: a loop the walk must leave


@dataclass(frozen=True)
class ByteTable:
    """Which token spells each single byte (None where no token does)."""

    ids: tuple[int | None, ...]

    @property
    def complete(self) -> bool:
        """Every byte that UTF-8 text can contain (0x00–0xF4) has a token, so the walk is never
        restricted (informative; the bound holds either way, module doc). NOTE: llguidance
        reserves 0xFF as its special-token marker."""
        return all(i is not None for i in self.ids[:0xF5])


_lock = threading.Lock()
# NOTE: keyed by id with the tokenizer kept alive (LLTokenizer takes no weak references); the
# engine's LLTokenizers are themselves cached per tokenizer, so this stays a handful of entries
_tables: dict[int, tuple[llg.LLTokenizer, ByteTable]] = {}


def byte_table(tok: llg.LLTokenizer) -> ByteTable:
    """The single-byte tokens of ``tok`` (cached per tokenizer)."""
    with _lock:
        entry = _tables.get(id(tok))
        cached = entry[1] if entry is not None and entry[0] is tok else None
        if cached is None:
            ids: list[int | None] = [None] * 256
            for b in range(256):
                toks = tok.tokenize_bytes(bytes([b]))
                if len(toks) == 1 and tok.decode_bytes(toks) == bytes([b]) and \
                        not tok.is_special_token(toks[0]):
                    ids[b] = toks[0]
            cached = ByteTable(tuple(ids))
            _tables[id(tok)] = (tok, cached)
        return cached


@dataclass(frozen=True)
class ClosingPath:
    """A completion from the current state to an accepting one, as tokens."""

    tokens: tuple[int, ...]
    text: bytes

    def __len__(self) -> int:
        return len(self.tokens)


def closing_path(m: llg.LLMatcher, tok: llg.LLTokenizer, table: ByteTable,
                 limit: int = MAX_WALK, lead: bytes = b"") -> ClosingPath | None:
    """A short completion of ``m``'s output (see the module doc), or None when none is found
    within ``limit`` steps (bytes taken, a cut-back run's included). ``lead``: bytes the completion must start with (the rest of a begun
    trigger), taken before the walk even where the output accepts. ``m`` is left in the state
    it was in."""
    if m.is_error():
        return None
    consumed: list[int] = []
    text = bytearray()
    used = [0] * 256     # NOTE: times each byte was chosen (not forced) in this walk
    run = 0              # how many times in a row the last byte was chosen
    looping = False      # a run reached STALL_RUN: prefer the least used bytes from now on
    try:
        for b in lead:
            tid = table.ids[b]
            if tid is None or m.try_consume_tokens([tid]) != 1:
                return None
            consumed.append(tid)
            text.append(b)
        steps = 0
        while not m.is_accepting():
            steps += 1  # NOTE: not len(text): a cut-back run must not walk for ever
            if steps > limit:
                return None
            # NOTE: holds the GIL: on a grammar whose forced bytes never end (see
            # coda.engine.grammar_guard) it never returns, and no bound can stop it; only a
            # request that opts a Lark grammar into closure reaches such a state here
            forced = m.compute_ff_bytes()
            in_text = False
            if forced:
                candidates: list[int] = [forced[0]]
            else:
                probe = table.ids[_PROBE]
                in_text = probe is not None and m.validate_tokens([probe]) == 1
                candidates = _ORDER_TEXT if in_text else _ORDER
                if looping:  # NOTE: a stable sort: the preference order among equal counts
                    candidates = sorted(candidates, key=used.__getitem__)
            for b in candidates:
                tid = table.ids[b]
                if tid is not None and m.try_consume_tokens([tid]) == 1:
                    if not forced and (in_text or b not in _CLOSERS):
                        run = run + 1 if text and text[-1] == b else 1
                        used[b] += 1
                    consumed.append(tid)
                    text.append(b)
                    break
            else:
                return None
            if looping and b == _QUOTE:  # NOTE: the string that looped is closed: plain again
                looping, used = False, [0] * 256
            if run >= STALL_RUN:
                # NOTE: the byte may repeat forever (`^[0-9]+x$`, an email's local part): cut
                # the run back to one and leave it by the least used bytes (module doc)
                m.rollback(run - 1)
                del consumed[len(consumed) - run + 1:], text[len(text) - run + 1:]
                run, looping = 0, True
    finally:
        if consumed:
            m.rollback(len(consumed))
    raw = bytes(text)
    canonical = tok.tokenize_bytes(raw) if raw else []
    if canonical and len(canonical) < len(consumed) and m.validate_tokens(canonical) == len(
            canonical) and tok.decode_bytes(canonical) == raw:
        return ClosingPath(tuple(canonical), raw)
    return ClosingPath(tuple(consumed), raw)
