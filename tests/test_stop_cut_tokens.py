"""At a stop hit the last delta's tokens are cut to the text (SPEC S3, K2), and the stop's own
tokens are not lost: every selected token is in a delta or the terminal's trailing tokens (the
invariant the engine oracles read: tests/engine_support.py ``outcome_of``)."""

from __future__ import annotations

from coda.finish import FinishReason
from coda.output import OutputProcessor
from coda.stream import EventType, RequestStream, TokenInfo
from coda.trace import NullTraceSink
from tests.scripted import output_spec, scripted_tokenizer

TABLE = {101: b"AB", 102: b"CD", 103: b"EF"}
TOK = scripted_tokenizer(TABLE)


def _run(stops: tuple[str, ...]) -> tuple[RequestStream, list[TokenInfo], FinishReason | None]:
    stream = RequestStream("r")
    proc = OutputProcessor("r", TOK, output_spec(stop_strings=stops), stream, NullTraceSink())
    reason = None
    for i in (101, 102, 103):
        reason = proc.on_token(i, TokenInfo(i, -0.1, piece=TABLE[i]))
    return stream, list(proc.trailing_tokens()), reason


def test_s3_k2_the_stops_own_tokens_stay_trailing_not_dropped() -> None:
    """S3, K2: ``"BCDX"`` holds ``B`` through ``CD``, then ``"CDEF"`` hits at ``C``: the text is
    ``AB``, the delta tokens' bytes are ``AB`` and tokens 102, 103 (the stop's own) are the
    trailing ones."""
    stream, trailing, reason = _run(("BCDX", "CDEF"))
    deltas = [e for e in stream.events_after(-1) if e.type is EventType.DELTA]
    assert reason is FinishReason.STOP_SEQUENCE
    assert b"".join(e.text.encode() for e in deltas) == b"AB"
    assert b"".join(t.piece for e in deltas for t in e.tokens) == b"AB"
    assert [t.token_id for e in deltas for t in e.tokens] + [
        t.token_id for t in trailing] == [101, 102, 103]


def test_s3_k2_the_token_a_stop_cuts_keeps_its_bytes_before_the_stop() -> None:
    """S3, K2: ``"F"`` ends the text inside 103 (``EF``): its piece is ``E``."""
    stream, trailing, _ = _run(("F",))
    deltas = [e for e in stream.events_after(-1) if e.type is EventType.DELTA]
    assert "".join(e.text for e in deltas) == "ABCDE"
    assert [(t.token_id, t.piece) for e in deltas for t in e.tokens] == [
        (101, b"AB"), (102, b"CD"), (103, b"E")]
    assert trailing == []
