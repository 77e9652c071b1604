"""Which delta carries a token whose piece is not its text (SPEC K2, S2; coda.output's
``_note_detok_end`` and ``_complete``, coda.token_ends): a token goes with the delta that sends
its last byte. Its end is set once the detokenizer holds none of its bytes
(``IncrementalDetokenizer.held_tokens``), where its pieces, decoded, meet the detokenized text;
where they do not (a decoder that drops bytes, e.g. SentencePiece's stripped first space, or
pieces written longer than their text here), at the end of the text released so far. The
first cases are the ones the mutation run of 2026-12-04 left alive (docs/testing.md,
``output.py``); the pieces are given directly, as the engine would report them
(``TokenInfo.piece``), over a scripted byte-level tokenizer, so the detokenizer's text and
the pieces differ exactly as written.
"""

from __future__ import annotations

from coda.finish import FinishReason
from coda.output import OutputProcessor
from coda.stream import EventType, RequestStream, TokenInfo
from coda.trace import NullTraceSink
from tests.scripted import output_spec, scripted_tokenizer


def _deltas(table: dict[int, bytes], script: list[tuple[int, bytes]],
            stops: tuple[str, ...] = ()) -> list[tuple[bytes, list[int]]]:
    """Run ``script`` ((id, piece) per token) to its budget; each delta's bytes and ids."""
    stream = RequestStream("r")
    proc = OutputProcessor("r", scripted_tokenizer(table),
                           output_spec(max_tokens=len(script), stop_strings=stops), stream,
                           NullTraceSink())
    for i, piece in script:
        reason = proc.on_token(i, TokenInfo(i, -0.5, piece=piece))
    assert reason is FinishReason.MAX_OUTPUT_TOKENS
    proc.drain(reason)
    return [(e.data, [t.token_id for t in e.tokens]) for e in stream.events_after(-1)
            if e.type is EventType.DELTA]


def test_k2_every_token_of_a_split_character_gets_its_detokenized_end() -> None:
    """K2: ``"€"`` in three byte tokens, the first piece two bytes longer than its text (a
    decoder that drops them): the detokenizer holds the first two, the third completes the
    character, and all three ends are set at once, so all three ride with ``"€"`` (the pieces
    do not decode to the text: each ends where the released text ends)."""
    table = {101: b"\xe2", 102: b"\x82", 103: b"\xac"}
    assert _deltas(table, [(101, b"  \xe2"), (102, b"\x82"), (103, b"\xac")]) == [
        ("€".encode(), [101, 102, 103])]


def test_k2_s2_a_held_tokens_end_is_not_moved_by_a_later_push() -> None:
    """K2, S2: SentencePiece's stripped first space (piece ``" a"``, text ``"a"``) and stop
    ``"a."``: each ``"a"`` is held until the next one rules the stop out. The first token's
    detokenized end (1) was set at its own push; the next push must not move it to 2, or its
    entry would wait a delta."""
    table = {101: b"a"}
    assert _deltas(table, [(101, b" a"), (101, b"a"), (101, b"a")], ("a.",)) == [
        (b"a", [101]), (b"a", [101]), (b"a", [101])]


def test_k2_a_token_whose_tail_the_detokenizer_holds_waits_for_its_last_byte() -> None:
    """K2: ``b"\\xff\\xe2\\x82"`` then ``b"\\xac"``: the first push sends U+FFFD (three bytes,
    for ``\\xff``) and holds ``\\xe2\\x82``; the first token's last byte goes out only with
    ``"€"``, so both tokens ride with the second delta. It rode with U+FFFD while the piece
    count decided (its piece end, 3, equals the text's end); now the detokenizer's held
    tokens do (``held_tokens``, coda.token_ends)."""
    table = {101: b"\xff\xe2\x82", 102: b"\xac"}
    assert _deltas(table, [(101, b"\xff\xe2\x82"), (102, b"\xac")]) == [
        ("\ufffd".encode(), []), ("€".encode(), [101, 102])]
