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

from coda.detokenizer import profile_of
from coda.finish import FinishReason
from coda.output import OutputProcessor
from coda.reasoning import ReasoningSpec
from coda.stream import EventType, RequestStream, TokenInfo
from coda.trace import NullTraceSink
from tests.scripted import output_spec, scripted_tokenizer
from tests.tokenizer_fixtures import sentencepiece_bpe


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


def _fallback_deltas(tokens: list[str], stop: str = ""
                     ) -> tuple[list[tuple[bytes, list[int]]], list[int]]:
    """Run SentencePiece ``tokens`` (a byte-fallback tokenizer) to the budget, or to the stop
    id ``stop``, and drain; each delta's bytes and ids, and the trailing ids."""
    tok = sentencepiece_bpe()
    ids = [tok.token_to_id(t) for t in tokens]
    stops = ((tok.token_to_id(stop),),) if stop else ()
    stream = RequestStream("r")
    proc = OutputProcessor("r", tok, output_spec(max_tokens=len(ids), stop_token_ids=stops),
                           stream, NullTraceSink())
    pieces = profile_of(tok)
    for i in ids:
        reason = proc.on_token(i, TokenInfo(i, -0.5, piece=pieces.piece(i)))
    assert reason is (FinishReason.STOP_SEQUENCE if stop else FinishReason.MAX_OUTPUT_TOKENS)
    proc.drain(reason)
    return ([(e.data, [t.token_id for t in e.tokens]) for e in stream.events_after(-1)
             if e.type is EventType.DELTA], [t.token_id for t in proc.trailing_tokens()])


def test_k2_g2_a_byte_run_the_drain_sends_carries_its_tokens() -> None:
    """K2, G2: a byte-fallback run ``<0xC3><0xA9>`` ("é") is held to the end (one more byte
    could make it invalid); the drain sends it, and both tokens ride with that delta, not as
    the terminal's trailing tokens."""
    tok = sentencepiece_bpe()
    run = [tok.token_to_id(t) for t in ("<0xC3>", "<0xA9>")]
    deltas, trailing = _fallback_deltas(["<0xC3>", "<0xA9>"])
    assert (deltas, trailing) == ([("é".encode(), run)], [])


def test_k2_k3_a_budget_cut_partial_character_keeps_its_token_out_of_the_drains_delta() -> None:
    """K2, K3: ``<0xC3><0xA9><0xE2>`` at the budget: the drain sends "é" and cuts the partial
    ``\\xe2`` (recorded); "é"'s tokens ride with it, ``<0xE2>``'s byte was never sent, so it
    is a trailing token, not in the delta."""
    tok = sentencepiece_bpe()
    ids = [tok.token_to_id(t) for t in ("<0xC3>", "<0xA9>", "<0xE2>")]
    deltas, trailing = _fallback_deltas(["<0xC3>", "<0xA9>", "<0xE2>"])
    assert (deltas, trailing) == ([("é".encode(), ids[:2])], ids[2:])


def test_k2_s1_a_byte_run_an_id_sequence_closes_carries_its_tokens() -> None:
    """K2, S1: ``<0xC3><0xA9>`` then the stop id ``▁stop``: the run the sequence closed is
    drained from the detokenizer and sent ("é"), and both its tokens ride with that delta;
    ``▁stop`` is the stop's own, trailing. With ``<0xE2>`` after the run, its partial character
    is cut (K3) and its token, whose byte was never sent, is trailing too."""
    tok = sentencepiece_bpe()
    ids = [tok.token_to_id(t) for t in ("<0xC3>", "<0xA9>", "<0xE2>", "▁stop")]
    assert _fallback_deltas(["<0xC3>", "<0xA9>", "▁stop"], "▁stop") == (
        [("é".encode(), ids[:2])], ids[3:])
    assert _fallback_deltas(["<0xC3>", "<0xA9>", "<0xE2>", "▁stop"], "▁stop") == (
        [("é".encode(), ids[:2])], ids[2:])


def test_k2_issue23_reasoning_tokens_ride_with_their_reasoning_deltas() -> None:
    """K2, issue 23: inside a reasoning block no stop holds anything, so each token's entry
    rides with the reasoning delta that sends its bytes, the last one's too (nothing is an id
    sequence's own before the answer: ``_own`` starts at 0)."""
    tok = scripted_tokenizer({101: b"a", 102: b"b"}, added={150: "<think>", 151: "</think>"})
    spec = output_spec(max_tokens=3, reasoning=ReasoningSpec(close_ids=(151,), open_ids=(150,)))
    stream = RequestStream("r")
    proc = OutputProcessor("r", tok, spec, stream, NullTraceSink())
    for i, piece in ((150, b"<think>"), (101, b"a"), (102, b"b")):
        proc.on_token(i, TokenInfo(i, -0.5, piece=piece))
    assert [(e.data, [t.token_id for t in e.tokens], e.reasoning)
            for e in stream.events_after(-1) if e.type is EventType.DELTA] == [
        (b"a", [150, 101], True), (b"b", [102], True)]


def test_k2_s3_an_eos_end_reports_no_trailing_token() -> None:
    """K2, S3: at EOS nothing was cut, so no trailing token is shown text
    (``trailing_shown`` 0: the EOS token's entry is never reported)."""
    table = {101: b"a"}
    stream = RequestStream("r")
    proc = OutputProcessor("r", scripted_tokenizer(table),
                           output_spec(max_tokens=4, eos_token_ids=frozenset({0})), stream,
                           NullTraceSink())
    assert proc.on_token(101, TokenInfo(101, -0.5, piece=b"a")) is None
    assert proc.on_token(0, TokenInfo(0, -0.1)) is FinishReason.EOS
    assert proc.drain(FinishReason.EOS) is FinishReason.EOS
    assert (proc.trailing_shown, [t.token_id for t in proc.trailing_tokens()]) == (0, [0])
