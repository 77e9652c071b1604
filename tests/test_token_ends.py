"""The K2 last-byte map itself (SPEC K2, S1, S3; :mod:`coda.token_ends`), called directly with
hand-built pieces and detokenizer output: a token's entry goes with the delta that sends its
LAST byte, so ``TokenEnds.release`` must give, per released token, the output offset after the
character holding that byte (where the pieces decoded lossily meet the output) or, where they
do not meet, the end of the output released so far; ``piece_at`` maps a sent offset back to a
piece offset for a stop's cut (S3); ``rewind`` forgets an id sequence's bytes and tokens (S1);
``forget_before`` drops what is sent. Each case names the mutation-run survivors of
2026-12-04 it kills (docs/testing.md, ``token_ends.py``); 99 is a ``default`` no offset has.
"""

from __future__ import annotations

from coda.token_ends import TokenEnds, _unit

FFFD = "\ufffd".encode()


def _released(*pairs: tuple[bytes, bytes]) -> TokenEnds:
    """A map whose tokens (piece, output) were each pushed, output and released alone."""
    te = TokenEnds()
    for piece, out in pairs:
        te.push(piece)
        te.output(out)
        te.release(0)
    return te


def test_k2_unit_lengths_of_each_utf8_form_and_of_invalid_bytes() -> None:
    """K2: a character's piece bytes and text bytes, from the lead byte's class: the class
    edges U+0800 (lead 0xE0, 3 bytes) and U+10000 (lead 0xF0, 4 bytes) and a 4-byte character
    (kills ``< 0xE0`` → ``<= 0xE0`` / ``< 225``, ``< 0xF0`` → ``<= 0xF0`` / ``< 241``, ``4`` →
    ``5``); an invalid byte is one U+FFFD (3 text bytes for 1), a truncated character's maximal
    subpart too."""
    assert _unit(b"\x7f", 0) == (1, 1)
    assert _unit("\u07ff".encode(), 0) == (2, 2)
    assert _unit("\u0800".encode(), 0) == (3, 3)
    assert _unit("\uffff".encode(), 0) == (3, 3)
    assert _unit("\U00010000".encode(), 0) == (4, 4)
    assert _unit(b"a" + "\U0010ffff".encode(), 1) == (4, 4)
    assert _unit(b"\x80", 0) == (1, 3)
    assert _unit(b"\xe2\x82a", 0) == (2, 3)


def test_k2_one_token_whose_text_is_its_piece_maps_byte_for_byte() -> None:
    """K2, S3: the common case (one token, text == piece) ends at its text's end, and every
    offset inside it maps to the same piece offset, mid-character too (kills the fast path
    never taken: ``n == 1`` → ``!=``; its run mark dropped; ``o + size`` → ``o - size`` in
    ``piece_at``)."""
    te = TokenEnds()
    te.push("é".encode())
    te.output("é".encode())
    assert te.release(0) == [2]
    assert te.piece_at(1, 99) == 1
    assert te.piece_at(2, 99) == 2
    assert te.piece_at(3, 99) == 99


def test_k2_a_held_token_whose_bytes_are_out_is_not_released() -> None:
    """K2: two tokens, both bytes out, the last still held: only the first is released, at its
    own end, not at the output's (kills ``1 == len(held)`` → ``!=``, ``rel <= 0`` → ``<= 1``)."""
    te = TokenEnds()
    te.push(b"a")
    te.push(b"b")
    te.output(b"ab")
    assert te.release(1) == [1]
    assert te.release(0) == [2]


def test_k2_release_with_nothing_to_release_is_empty() -> None:
    """K2: more held than pushed releases nothing (kills ``return []`` → ``pass``)."""
    assert TokenEnds().release(1) == []
    te = TokenEnds()
    te.push(b"a")
    assert te.release(3) == []


def test_k2_empty_pieces_end_where_the_output_stands() -> None:
    """K2: a token that shows no bytes (a skipped special token) before any text ends at the
    output so far (0); the next ones at their own characters (kills ``rel <= 0`` → ``< 0``,
    its ``append`` → ``pass``, ``continue`` → ``pass`` / ``break``)."""
    te = TokenEnds()
    for piece in (b"", b"a", b"b"):
        te.push(piece)
    te.output(b"ab")
    assert te.release(0) == [0, 1, 2]


def test_k2_an_invalid_byte_ends_after_its_replacement_character() -> None:
    """K2: pieces ``"\\xff"``, ``"a"``: the text is U+FFFD (3 bytes) then ``"a"``; the first
    token ends at 3, the second at 4 (kills the span walk on text ends instead of piece ends),
    and the piece offset of 3 is 1 until it is forgotten (kills ``forget_before``'s
    ``m[0] + m[2]`` → ``m[1] + m[2]`` / ``m[0] - m[2]`` and ``>=`` → ``>``)."""
    te = TokenEnds()
    te.push(b"\xff")
    te.push(b"a")
    te.output(FFFD + b"a")
    assert te.release(0) == [3, 4]
    te.forget_before(3)
    assert te.piece_at(3, 99) == 1
    te.forget_before(4)
    assert te.piece_at(3, 99) == 99
    assert te.piece_at(4, 99) == 2


def test_k2_a_run_mark_is_kept_until_its_end_is_sent() -> None:
    """S3: a run mark (one token, text == piece) still maps its inside offsets after an
    earlier offset is forgotten, and forgetting drops marks wholly before the offset (kills
    ``forget_before``'s ``- m[2]`` and the assignment → ``pass``)."""
    te = _released((b"ab", b"ab"))
    te.forget_before(1)
    assert te.piece_at(1, 99) == 1
    te.forget_before(3)
    assert te.piece_at(0, 99) == 99


def test_k2_a_fresh_map_knows_only_offset_zero() -> None:
    """S3: before any output only offset 0 is known (kills the initial mark ``(0, 0, 1)``)."""
    assert TokenEnds().piece_at(0, 99) == 0
    assert TokenEnds().piece_at(1, 99) == 99


def test_k2_character_marks_stop_at_the_released_end() -> None:
    """K2, S3: ``"é"`` released, ``"x"`` held (not output): offset 2 maps to piece 2, an
    offset past it is unknown (kills the mark walk's ``o > o_done`` → ``>=``, its length
    ``0`` → ``1``); a held token's bytes that the output never had give no mark (``break`` →
    ``pass``: pieces ``"a"``, ``"\\xff"`` held, U+FFFD would end at 4)."""
    te = TokenEnds()
    te.push("é".encode())
    te.push(b"x")
    te.output("é".encode())
    assert te.release(1) == [2]
    assert te.piece_at(2, 99) == 2
    assert te.piece_at(3, 99) == 99
    te = TokenEnds()
    te.push(b"a")
    te.push(b"\xff")
    te.output(b"a")
    assert te.release(1) == [1]
    assert te.piece_at(4, 99) == 99


def test_k2_unmatched_output_falls_back_to_the_released_end() -> None:
    """K2: a decoder that rewrites its piece (``"x"`` shown as ``"Y"``): the token ends where
    the released output ends, by default (kills ``fallback=False`` as the default), and that
    offset maps to the token's piece end, nothing past it (kills the fallback mark → ``pass``,
    ``o0 - o_done``, ``p0 - p_done``, length ``1``)."""
    te = TokenEnds()
    te.push(b"x")
    te.output(b"Y")
    assert te.release(0) == [1]
    assert te.piece_at(1, 99) == 1
    assert te.piece_at(2, 99) == 99


def test_k2_fallback_after_earlier_releases_counts_absolute_offsets() -> None:
    """K2: after ``"a"`` is released (offsets 1, 1), a rewritten ``"x"`` falls back to output 2
    and piece 2 (kills ``held[n-1] - p0`` → ``+ p0``); a matched token before an unmatched one
    keeps its own end (kills ``ends +=`` → ``=`` and ``o0 + o_done`` → ``-``); with one held
    behind it, the fallback piece end is the released token's (kills ``n - 1`` → ``n - 2``)."""
    te = _released((b"a", b"a"))
    te.push(b"x")
    te.output(b"Y")
    assert te.release(0) == [2]
    assert te.piece_at(2, 99) == 2
    te = _released((b"z", b"z"))
    te.push(b"a")
    te.push(b"x")
    te.output(b"aY")
    assert te.release(0) == [2, 3]
    te = TokenEnds()
    te.push(b"x")
    te.push(b"zz")
    te.output(b"Y")
    assert te.release(1) == [1]
    assert te.piece_at(1, 99) == 1


def test_k2_a_cut_tail_leaves_its_tokens_unreleased() -> None:
    """K2, K3: without ``fallback`` (a cut tail) the unmatched tokens get None and stay
    unreleased, the matched ones are released: a later release still ends them (kills ``+=
    [None]`` → ``pass``, ``n -= left`` → ``pass`` / ``= left`` / ``+= left``, and the first
    matched bookkeeping starting at 1)."""
    te = TokenEnds()
    te.push(b"\xe2")
    assert te.release(0, fallback=False) == [None]
    assert te.out_end == 0
    te.push(b"\x82\xac")
    te.output("€".encode())
    assert te.release(0) == [3, 3]
    te = TokenEnds()
    for piece in (b"a", b"b", b"\xe2"):
        te.push(piece)
    te.output(b"ab")
    assert te.release(0, fallback=False) == [1, 2, None]
    assert te.release(0) == [2]


def test_k2_held_characters_map_before_release() -> None:
    """S3: a held token's characters that the output already has map to their piece offsets
    (a stop's cut inside them); the first offset the output and pieces disagree on, and past
    it, does not (kills ``piece_at``'s walk: ``or`` → ``and``, ``o > same`` → ``>=``,
    ``o0 + o >= out``, ``break`` → ``pass`` / ``return``, ``o0 - o == out``, its ``return`` →
    ``pass``)."""
    te = TokenEnds()
    te.push("é".encode())
    te.push(b"x")
    te.output("é".encode())
    assert te.piece_at(2, 99) == 2
    te = TokenEnds()
    te.push(b"ab")
    te.output(b"aY")
    assert te.piece_at(1, 99) == 1
    assert te.piece_at(2, 99) == 99


def test_s1_rewind_drops_the_sequences_output_and_held_tokens() -> None:
    """S1, K2: ``"z"`` released, then ``"a"`` and an id sequence's ``"b"`` pushed and output,
    held: rewinding to 2 with one token leaves ``"a"`` alone, which then releases at 2 with its
    piece offset (kills the output ``del`` → ``pass`` / ``+ o0``, the held ``del`` → ``pass``
    / ``+ drop``, the pieces ``del`` → ``pass`` / ``+ p0``)."""
    te = _released((b"z", b"z"))
    te.push(b"a")
    te.output(b"a")
    te.push(b"b")
    te.output(b"b")
    te.rewind(2, 1)
    assert te.out_end == 2
    assert te.release(0) == [2]
    te.push(b"c")
    te.output(b"c")
    assert te.release(0) == [3]
    assert te.piece_at(3, 99) == 3


def test_s1_rewind_of_every_held_token_clears_their_pieces() -> None:
    """S1: ``"z"`` released, an id sequence's ``"ab"`` held with no output: rewound, no piece
    of it is left, so the next token's run maps piece for output (kills ``max(…, 0)`` → ``1``
    for the pieces and for the output)."""
    te = _released((b"z", b"z"))
    te.push(b"ab")
    te.rewind(1, 1)
    assert te.out_end == 1
    te.push(b"c")
    te.output(b"c")
    assert te.release(0) == [2]
    assert te.piece_at(2, 99) == 2
    te = _released((b"z", b"z"))
    te.push(b"b")
    te.output(b"b")
    te.rewind(1, 1)
    assert te.out_end == 1


def test_s1_rewind_into_released_output_forgets_its_marks() -> None:
    """S1, S3: the sequence's token was already released: rewinding moves the output back
    (kills ``o0 = min(…)`` → ``pass``), its offsets are no longer known (kills the marks filter
    → ``pass``, ``- m[2]``, and ``m[1]`` for ``m[0]``), the offset it starts at still is (kills
    ``<=`` → ``<``)."""
    te = _released((b"z", b"z"), (b"qr", b"qr"))
    te.rewind(1, 1)
    assert te.out_end == 1
    assert te.piece_at(1, 99) == 1
    assert te.piece_at(2, 99) == 99
    te = _released((b"\xff", FFFD), (b"a", b"a"))
    te.rewind(3, 1)
    assert te.piece_at(3, 99) == 1
    assert te.piece_at(4, 99) == 99
