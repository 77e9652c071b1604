"""At a stop hit the last delta's tokens are cut to the text (SPEC S3, K2), and the stop's own
tokens are not lost: every selected token is in a delta or the terminal's trailing tokens (the
invariant the engine oracles read: tests/engine_support.py ``outcome_of``)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coda.finish import FinishReason
from coda.output import OutputProcessor
from coda.output_delta import cut_to_text
from coda.stream import EventType, RequestStream, TokenInfo, shown_bytes
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


_TOKENS = st.lists(st.tuples(st.binary(max_size=4), st.booleans()), max_size=12)


@settings(deadline=None)
@given(_TOKENS, st.booleans(), st.integers(min_value=0, max_value=60))
def test_s3_k2_cut_to_text_keeps_exactly_the_budget_for_all_tokens(
        tokens: list[tuple[bytes, bool]], skip: bool, budget: int) -> None:
    """For all tokens and budgets: the cut tokens are a prefix of the tokens (the stop's own
    are dropped, none skipped over), and their shown bytes are the first ``budget`` bytes of
    the tokens' text (all of it when the budget covers it)."""
    infos = [TokenInfo(i, -0.5, piece=p, special=s) for i, (p, s) in enumerate(tokens)]
    text = b"".join(p for p, s in tokens if not (skip and s))
    cut = cut_to_text(infos, budget, skip)
    assert [t.token_id for t in cut] == [t.token_id for t in infos[:len(cut)]]
    assert b"".join(t.piece for t in cut if not (skip and t.special)) == text[:budget]
    assert len(cut) == len(infos) or budget < len(text)


def test_k2_shown_bytes_counts_a_skipped_special_as_nothing() -> None:
    """K2: a special token adds its bytes to the text only when the request keeps specials."""
    sp, plain = TokenInfo(1, -0.1, piece=b"<s>", special=True), TokenInfo(2, -0.1, piece=b"ab")
    assert (shown_bytes(sp, True), shown_bytes(sp, False)) == (0, 3)
    assert (shown_bytes(plain, True), shown_bytes(plain, False)) == (2, 2)


def test_s3_k2_a_stop_cut_after_removed_reasoning_markers_keeps_the_markers_tokens() -> None:
    """S3, K2, issue 23: the markers' bytes are removed from the text but their tokens were
    sent with the reasoning, so the cut's budget counts them: with ``<think>a</think>ab`` and
    stop ``"b"`` the answer is ``a`` and the tokens' bytes are ``<think>a</think>a`` (the cut
    token 107 keeps ``a``)."""
    from coda.reasoning import ReasoningSpec

    open_id, close_id = 150, 151
    table = {101: b"a", 107: b"ab"}
    tok = scripted_tokenizer(table, added={open_id: "<think>", close_id: "</think>"})
    pieces = {**table, open_id: b"<think>", close_id: b"</think>"}
    stream = RequestStream("r")
    spec = output_spec(stop_strings=("b",), max_tokens=10, reasoning=ReasoningSpec(
        inside=False, close_ids=(close_id,), open_ids=(open_id,)))
    proc = OutputProcessor("r", tok, spec, stream, NullTraceSink())
    reason = None
    for i in (open_id, 101, close_id, 107):
        reason = proc.on_token(i, TokenInfo(i, -0.1, piece=pieces[i]))
    deltas = [e for e in stream.events_after(-1) if e.type is EventType.DELTA]
    assert reason is FinishReason.STOP_SEQUENCE
    assert [(e.text, e.reasoning) for e in deltas] == [("a", True), ("a", False)]
    assert [(t.token_id, t.piece) for e in deltas for t in e.tokens] == [
        (open_id, b"<think>"), (101, b"a"), (close_id, b"</think>"), (107, b"a")]


def test_s3_k2_a_straddle_cut_after_removed_reasoning_markers_counts_them() -> None:
    """S3, K2, issue 23: the straddle after a reasoning block: ``<think>a</think>`` then
    ``"x\n"``, ``"\ny"`` with stop ``"\n\n"``: the text ends at ``"x"`` and the token
    ``"x\n"`` (its ``"\n"`` held, S2) is the terminal's first trailing token cut to ``"x"``;
    the cut's budget counts the removed markers' bytes, whose tokens were sent."""
    from coda.reasoning import ReasoningSpec

    open_id, close_id = 150, 151
    table = {101: b"a", 108: b"x\n", 109: b"\ny"}
    tok = scripted_tokenizer(table, added={open_id: "<think>", close_id: "</think>"})
    pieces = {**table, open_id: b"<think>", close_id: b"</think>"}
    stream = RequestStream("r")
    spec = output_spec(stop_strings=("\n\n",), max_tokens=10, reasoning=ReasoningSpec(
        inside=False, close_ids=(close_id,), open_ids=(open_id,)))
    proc = OutputProcessor("r", tok, spec, stream, NullTraceSink())
    reason = None
    for i in (open_id, 101, close_id, 108, 109):
        reason = proc.on_token(i, TokenInfo(i, -0.1, piece=pieces[i]))
    deltas = [e for e in stream.events_after(-1) if e.type is EventType.DELTA]
    assert reason is FinishReason.STOP_SEQUENCE
    assert [(e.text, e.reasoning) for e in deltas] == [("a", True), ("x", False)]
    assert [t.token_id for e in deltas for t in e.tokens] == [open_id, 101, close_id]
    assert proc.trailing_shown == 1
    assert [(t.token_id, t.piece) for t in proc.trailing_tokens()][:1] == [(108, b"x")]


def test_s3_cut_to_text_reports_nothing_past_the_cut() -> None:
    """S3, K2: past the text's end nothing is reported: at a budget that ends between tokens
    the next token is not kept (not even with no bytes), and after the token the stop cut no
    later token is kept."""
    infos = [TokenInfo(i, -0.1, piece=p) for i, p in enumerate((b"AB", b"CD", b"EF"))]
    assert [(t.token_id, t.piece) for t in cut_to_text(infos, 2, True)] == [(0, b"AB")]
    assert [(t.token_id, t.piece) for t in cut_to_text(infos, 3, True)] == [
        (0, b"AB"), (1, b"C")]
    assert cut_to_text(infos, 0, True) == ()
