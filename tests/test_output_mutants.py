"""OutputProcessor driven directly, one token at a time (SPEC S1–S4, K2, K3, G2, L6, issue 20
D6/D9, issue 23): the exact trace rows, deltas and end state of the id-sequence drain, the
DRAINING step, the cancel path and the reasoning split -- the cases the output mutation run
found unasserted (scripts/mutation.sh ``[output]``)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import tokenizers

from coda import trace as tr
from coda.detokenizer import IncrementalDetokenizer
from coda.errors import DecodingError
from coda.finish import FinishReason
from coda.output import OutputProcessor
from coda.output_tag import _tag_start_len
from coda.reasoning import ReasoningSpec
from coda.stream import EventType, RequestStream, TokenInfo
from coda.trace import ListTraceSink
from tests.scripted import output_spec, scripted_tokenizer
from tests.tokenizer_fixtures import sentencepiece_bpe

SP = sentencepiece_bpe()
_V = SP.get_vocab()
B_H, B_I = _V["<0x68>"], _V["<0x69>"]  # byte-fallback tokens "h", "i"
# NOTE: two plain word pieces of the trained vocabulary (as tests/test_step_stops_fallback.py)
AN, EP = (_V[k] for k in sorted(k for k in _V if re.fullmatch("▁[a-z]{2,3}", k))[:2])
AN_TEXT = SP.decode([EP, AN]).encode()[len(SP.decode([EP]).encode()):]  # " xy" after EP

OPEN_ID, CLOSE_ID = 150, 151
TABLE = {201: b"a", 202: b"</thi", 203: b"nk>xy", 204: b"z", 205: b"<th", 206: b"q\xc3", 207: b"q",
         208: b"z<th", 209: b"</", 210: b"thi", 211: b"nk>"}
BL = scripted_tokenizer(TABLE, added={OPEN_ID: "<think>", CLOSE_ID: "</think>"})


class Run:
    """One processor on a fresh stream and trace."""

    def __init__(self, tok: tokenizers.Tokenizer, **kw: Any) -> None:
        self.sink = ListTraceSink()
        self.stream = RequestStream("r")
        self.proc = OutputProcessor("r", tok, output_spec(**kw), self.stream, self.sink,
                                    prompt_token_ids=(EP,) if tok is SP else ())

    def feed(self, ids: list[int]) -> FinishReason | None:
        reason = None
        for i in ids:
            reason = self.proc.on_token(i, TokenInfo(i, -0.1))
            if reason is not None:
                break
        return reason

    def text(self, reasoning: bool = False) -> bytes:
        return b"".join(e.text.encode() for e in self.stream.events_after(-1)
                        if e.type is EventType.DELTA and e.reasoning is reasoning)

    def deltas(self) -> list[Any]:
        return [e for e in self.stream.events_after(-1) if e.type is EventType.DELTA]

    def rows(self, kind: str) -> list[dict[str, Any]]:
        return [dict(e.data) for e in self.sink.events if e.kind == kind]


# -- S1, S3, K2, S4: an id sequence ends the output; the text before it is drained ----------

def test_s1_k2_id_hit_drains_the_byte_run_and_records_the_rewind() -> None:
    """S1, S3, K2: "hi" waits in the detokenizer; (AN, EP) hits: "hi" (closed by AN, pushed as
    held ids) is sent, nothing of the sequence; the drain's row rewinds the sequence's bytes."""
    r = Run(SP, stop_token_ids=((AN, EP),))
    assert r.feed([B_H, B_I, AN, EP]) is FinishReason.STOP_SEQUENCE
    assert r.text() == b"hi"
    assert r.rows(tr.STOP_STATE)[-1] == {"nbytes": 2, "starts": 2, "held": 0, "detok_pending": 0,
                                         "ids_held": 0, "discarded": len(b"hi" + AN_TEXT),
                                         "held_before": 0}


def test_s1_k3_three_id_sequence_drains_from_the_state_before_its_first_id() -> None:
    """S1, K2: a 3-id sequence restores the detokenizer as it was before its first id (two forks
    back), so the byte run "hi" the first id closed is still output."""
    r = Run(SP, stop_token_ids=((AN, EP, AN),))
    assert r.feed([B_H, B_I, AN, EP, AN]) is FinishReason.STOP_SEQUENCE
    assert r.text() == b"hi"
    assert r.proc.hit is not None and r.proc.hit.kind == "token_ids"


def test_s4_drained_bytes_complete_a_stop_string_even_as_a_tag_start() -> None:
    """S4: "hi" drained at the id hit is final (no byte follows), so its "i" is not kept as the
    start of the tag "i<": stop "hi" completes there, ends before the ids and wins."""
    r = Run(SP, stop_token_ids=((AN,),), stop_strings=("hi",), stops_end_at=b"i<")
    assert r.feed([B_H, B_I, AN]) is FinishReason.STOP_SEQUENCE
    assert r.text() == b""
    assert r.proc.hit is not None and r.proc.hit.kind == "string"


# -- G2: the DRAINING step after a hit, and the cancel path ---------------------------------

def test_g2_drain_after_a_hit_discards_the_detokenizer_tail_and_closes_the_matcher() -> None:
    """G2: after a stop hit the detokenizer's pending partial character is discarded (recorded
    as such), never finished, and the string matcher is closed."""
    r = Run(BL, stop_strings=("q",))
    assert r.feed([206]) is FinishReason.STOP_SEQUENCE
    assert r.proc.detok.pending == b"\xc3"
    assert r.proc.drain(FinishReason.STOP_SEQUENCE) is FinishReason.STOP_SEQUENCE
    assert r.proc.detok.pending == b""
    assert r.proc.detok.removed_spans[-1].reason == "pending_discarded"


def test_g2_drain_after_an_id_hit_drops_the_held_stop_prefix() -> None:
    """G2, S2: "a" is held as the start of stop "ab" when the id (204,) hits: it is text before
    the sequence (sent), and the drain closes the matcher with nothing held."""
    r = Run(BL, stop_strings=("az",), stop_token_ids=((204,),))
    assert r.feed([201, 204]) is FinishReason.STOP_SEQUENCE
    assert r.text() == b"a"
    r.proc.drain(FinishReason.STOP_SEQUENCE)
    snap = r.proc.stops.snapshot()
    assert snap["closed"] is True and r.proc.stops.held == b""


def test_seed43_cancel_discards_held_bytes_and_the_detokenizer_tail() -> None:
    """Seed §4.3 cancel path: the held stop prefix "q" is dropped (counted as dropped, the
    matcher closed) and the pending partial character discarded; nothing more is sent."""
    r = Run(BL, stop_strings=("qz",))
    assert r.feed([206]) is None
    r.proc.discard()
    assert r.text() == b""
    assert r.proc.stops.held == b"" and r.proc.stops.dropped_bytes == 1
    assert r.proc.stops.snapshot()["closed"] is True
    assert r.proc.detok.pending == b""
    assert r.proc.detok.removed_spans[-1].reason == "pending_discarded"


# -- K3: the utf8_tail policies at the drain ------------------------------------------------

def _no_byte_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    """K3: make ``finish_cut`` meet a residue no byte could complete (it raises). Ordinary
    token streams never leave one (the detokenizer emits U+FFFD for such bytes at once), so
    the guarded paths are reached by forcing the detokenizer's documented failure."""
    def fail(self: IncrementalDetokenizer) -> tuple[bytes, bytes]:
        raise DecodingError(f"incomplete UTF-8 at end of output: {self.pending.hex()}")
    monkeypatch.setattr(IncrementalDetokenizer, "finish_cut", fail)


def test_k3_id_hit_after_an_invalid_residue_removes_it_at_the_drain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """K3, S1, G2: the residue before the sequence that no byte could complete is removed as
    after a hit, and the drain records it as the dropped tail."""
    r = Run(BL, stop_token_ids=((204,),))
    _no_byte_completes(monkeypatch)
    assert r.feed([206, 204]) is FinishReason.STOP_SEQUENCE
    assert r.proc.drain(FinishReason.STOP_SEQUENCE) is FinishReason.STOP_SEQUENCE
    assert r.text() == b"q" and r.proc.dropped_tail == b"\xc3"
    assert r.rows(tr.UTF8_TAIL_DROPPED)[-1]["hex"] == "c3"


def test_k3_auto_budget_end_with_an_invalid_residue_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """K3 "auto": a residue no byte could complete still fails at a budget end."""
    r = Run(BL, utf8_tail="auto")
    r.feed([206])
    _no_byte_completes(monkeypatch)
    with pytest.raises(DecodingError):
        r.proc.drain(FinishReason.MAX_OUTPUT_TOKENS)


def test_k3_drop_removes_an_invalid_residue_and_records_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """K3 "drop": any incomplete tail, also one no byte could complete, is removed, recorded."""
    r = Run(BL, utf8_tail="drop")
    r.feed([206])
    _no_byte_completes(monkeypatch)
    assert r.proc.drain(FinishReason.EOS) is FinishReason.EOS
    assert r.text() == b"q" and r.proc.dropped_tail == b"\xc3"


def test_k3_auto_budget_end_cuts_a_partial_character() -> None:
    """K3 "auto", K2: a budget end removes a partial last character, recorded; EOS fails."""
    r = Run(BL, utf8_tail="auto")
    r.feed([206])
    assert r.proc.drain(FinishReason.MAX_OUTPUT_TOKENS) is FinishReason.MAX_OUTPUT_TOKENS
    assert r.text() == b"q" and r.proc.dropped_tail == b"\xc3"
    r2 = Run(BL, utf8_tail="auto")
    r2.feed([206])
    with pytest.raises(DecodingError):
        r2.proc.drain(FinishReason.EOS)


# -- issue 23: the reasoning split ----------------------------------------------------------

def _reasoning(**kw: Any) -> Run:
    spec = ReasoningSpec(inside=True, close_ids=(CLOSE_ID,), open_ids=(OPEN_ID,))
    return Run(BL, reasoning=spec, **kw)


def test_issue23_s2_answer_bytes_of_the_closing_token_are_sent_at_once() -> None:
    """Issue 23, S2: "nk>xy" closes the block; its answer "xy" is sent with that token (no id
    holds it), its row counts all five bytes, reasoning rows hold no ids."""
    r = _reasoning()
    assert r.feed([201, 202, 203]) is None
    assert (r.text(reasoning=True), r.text()) == (b"a", b"xy")
    rows = r.rows(tr.STOP_STATE)
    assert [row["ids_held"] for row in rows] == [0, 0, 0]
    assert rows[-1]["nbytes"] == 5
    assert [row.get("reasoning") for row in r.rows(tr.STREAM_DELTA)] == [True, None]


def test_issue23_s3_stop_in_the_closing_tokens_answer_ends_there() -> None:
    """Issue 23, S3: stop "y" completes in the answer bytes of the closing token: the output
    ends at that token, and the hit's offset counts the reasoning and the markers (9 + 1)."""
    r = _reasoning(stop_strings=("y",))
    assert r.feed([201, 202, 203]) is FinishReason.STOP_SEQUENCE
    assert r.text() == b"x"
    assert r.rows(tr.STOP_HIT)[-1]["byte_offset"] == 10


def test_issue23_s1_id_hit_in_the_answer_counts_all_selected_tokens() -> None:
    """Issue 23, S1: the id matcher sees answer tokens only; the hit's span is shifted by the
    tokens before the answer (start 3, end 4)."""
    r = _reasoning(stop_token_ids=((204,),))
    assert r.feed([201, 202, 203, 204]) is FinishReason.STOP_SEQUENCE
    assert r.proc.hit is not None and (r.proc.hit.start, r.proc.hit.end) == (3, 4)


def test_issue23_s3_drain_of_a_partial_opener_is_answer_a_stop_can_end() -> None:
    """Issue 23, G2, S3: "<th" waits as a possible opener (decided on bytes); at the drain it
    is answer text, and stop "t" in it ends the output."""
    r = Run(BL, reasoning=ReasoningSpec(), stop_strings=("t",))
    assert r.feed([205]) is None
    assert r.proc.drain(FinishReason.EOS) is FinishReason.STOP_SEQUENCE
    assert r.text() == b"<"


def test_issue23_forced_token_is_none_without_a_reasoning_block() -> None:
    """Issue 23: no split, or a block already closed: no closer is forced."""
    assert Run(BL).proc.forced_token() is None
    r = Run(BL, reasoning=ReasoningSpec(inside=True, close_ids=(CLOSE_ID,), budget_tokens=0))
    r.feed([CLOSE_ID])
    assert r.proc.forced_token() is None


def test_issue23_budget_forces_the_closer_after_budget_tokens() -> None:
    """Issue 23: with a budget of 2 reasoning tokens the closer is forced only after two."""
    r = Run(BL, reasoning=ReasoningSpec(inside=True, close_ids=(CLOSE_ID,), budget_tokens=2))
    r.feed([201])
    assert (r.proc.forced_token(), r.proc.reasoning_tokens) == (None, 1)
    r.feed([201])
    assert r.proc.forced_token() == CLOSE_ID


def test_issue23_a_forced_multi_id_closer_is_forced_id_by_id() -> None:
    """Issue 23: a closer spelled by three ids is forced one id per step, in order, and the
    split records the forced close."""
    r = Run(BL, reasoning=ReasoningSpec(inside=True, close_ids=(209, 210, 211), budget_tokens=1))
    forced = []
    r.feed([201])
    for _ in range(4):  # NOTE: bounded: a wrong count must fail, not loop
        if (f := r.proc.forced_token()) is None:
            break
        forced.append(f)
        r.feed([f])
    assert forced == [209, 210, 211]
    split = r.proc.reasoning_split()
    assert split is not None and split.forced


def test_g2_normal_end_releases_held_bytes_and_closes_the_matcher() -> None:
    """G2, S2: at a normal end the held stop prefix "q" matched nothing: it is sent and the
    matcher is flushed (nothing held, closed)."""
    r = Run(BL, stop_strings=("qz",))
    assert r.feed([207]) is None and r.text() == b""
    assert r.proc.drain(FinishReason.EOS) is FinishReason.EOS
    assert r.text() == b"q"
    assert r.proc.stops.held == b"" and r.proc.stops.emitted_bytes == 1
    assert r.proc.stops.snapshot()["closed"] is True


# -- issue 20 D6, D9, issue 13 ---------------------------------------------------------------

@pytest.mark.parametrize("min_tokens", [0, 1])
def test_issue20_d6_stop_hit_row_states_armed_at_only_with_min_tokens(min_tokens: int) -> None:
    """Issue 20 D6: the stop.hit row says where stops were armed exactly when min_tokens > 0."""
    r = Run(BL, stop_strings=("a",), min_tokens=min_tokens)
    assert r.feed([201]) is FinishReason.STOP_SEQUENCE
    assert ("armed_at" in r.rows(tr.STOP_HIT)[-1]) is (min_tokens > 0)


def test_issue20_d9_first_delta_states_the_cached_prompt_tokens_only() -> None:
    """Issue 20 D9: the first delta carries the prefix-cache result (0 when never set), later
    deltas none."""
    r = Run(BL)
    r.feed([201, 204])
    assert [d.cached_prompt_tokens for d in r.deltas()] == [0, None]


def test_issue13_text_before_the_tag_is_matched_and_held_bytes_released() -> None:
    """Issue 13, S2: "qz" waits as the start of stop "qzz"; "z<th" completes the tag: the free
    text before it is matched (no hit), the held bytes are released (the row holds nothing)
    and stops are off ("th" inside the tag never cuts)."""
    r = Run(BL, stop_strings=("qzz", "th"), stops_end_at=b"<th")
    assert r.feed([201, 207, 208]) is None
    assert r.rows(tr.STOP_STATE)[-2]["stops_off"] is True
    assert r.rows(tr.STOP_STATE)[-1]["held"] == 0
    assert r.text() == b"aqz<th"


def test_issue13_s3_stop_in_the_text_before_the_tag_ends_the_output() -> None:
    """Issue 13, S3: the bytes before the tag in the same push complete stop "qz": it ends."""
    r = Run(BL, stop_strings=("qz",), stops_end_at=b"<th")
    assert r.feed([201, 207, 208]) is FinishReason.STOP_SEQUENCE
    assert r.text() == b"a"


def test_issue13_tag_start_len_is_a_proper_prefix_suffix() -> None:
    """Issue 13: the waiting part is the longest suffix that is a *proper* prefix of the tag."""
    assert _tag_start_len(b"abc", b"abc") == 0
    assert _tag_start_len(b"xa", b"abcd") == 1
    assert _tag_start_len(b"xab", b"abcd") == 2


def test_issue23_k2_cancel_never_counts_a_held_closer_prefix_as_sent() -> None:
    """Issue 23, K2, seed §4.3 cancel: "</thi" waits as a possible closer when the request is
    cancelled: it is never sent, so the split's reasoning byte count (the bytes of reasoning
    the stream sent) is the "a" that was sent, not 6."""
    r = _reasoning()
    assert r.feed([201, 202]) is None
    r.proc.discard()
    split = r.proc.reasoning_split()
    assert r.text(reasoning=True) == b"a"
    assert split is not None and split.reasoning_bytes == 1
    assert r.proc.splitter is not None and r.proc.splitter.held == 0  # NOTE: dropped


def test_issue23_l6_s4_id_hit_in_the_answer_counts_drained_bytes_from_the_answer_start() -> None:
    """Issue 23, L6, S1, S4: "h</think>" is one byte run closed by EP (one push: reasoning "h",
    the closer removed, the answer starts); "hi" waits as a run when id AN hits; drained, it
    completes stop "hi" at its first byte: nothing more is sent, and the drained tokens (their
    offset counted from the answer start) are not returned -- only the run's nine and EP are
    (L6: the run is released with EP's push; its closer bytes are removed, counted as reached)."""
    run = [_V[f"<0x{b:02X}>"] for b in b"h</think>"]
    r = Run(SP, reasoning=ReasoningSpec(inside=True, close_ids=(run[1],)),
            stop_token_ids=((AN,),), stop_strings=("hi",))
    assert r.feed([*run, EP, B_H, B_I, AN]) is FinishReason.STOP_SEQUENCE
    assert r.proc.hit is not None and r.proc.hit.kind == "string"
    assert r.text(reasoning=True) == b"h" and b"hi" not in r.text()
    assert r.proc.returned_tokens == len(run) + 1


def test_issue23_l6_s4_a_drained_run_a_stop_string_cuts_is_not_returned_after_reasoning() -> None:
    """Issue 23, L6, S1, S4 (the survivor ``upto + _answer_base`` → ``-`` where the drain
    rebases ``_visible``, coda.output_ids): as above, but the answer's last byte (EP's, " do"
    with the fixture's usual vocabulary) waits as the start of a stop string. Drained at id
    AN's hit, "hi" rules that stop out and completes stop "hi", so the held byte is sent and
    the returned count moves while nothing of "hi" is sent: the drained token starts at the
    answer's start (9: "h" and the removed closer) plus its stream offset, not before it, and
    is not returned; only the run's tokens and EP's are (L6: released with EP's push)."""
    run = [_V[f"<0x{b:02X}>"] for b in b"h</think>"]
    last = SP.decode([EP])[-1]
    r = Run(SP, reasoning=ReasoningSpec(inside=True, close_ids=(run[1],)),
            stop_token_ids=((AN,),), stop_strings=("hi", last + "~"))
    assert r.feed([*run, EP, B_H, B_I, AN]) is FinishReason.STOP_SEQUENCE
    answer = r.text()
    assert r.text(reasoning=True) == b"h" and answer.endswith(last.encode())
    assert r.proc.hit is not None and (r.proc.hit.kind, r.proc.hit.start) == ("string",
                                                                              len(answer))
    n = len(run) + 1
    assert r.proc.returned_tokens == n and r.proc.sent_mark == (1 + len(answer), n)


def test_l6_sent_mark_is_zero_until_a_delta_moves_it() -> None:
    """L6: ``sent_mark`` (the (bytes, returned tokens) pair a billing reader on another thread
    reads) starts at (0, 0) and stays there while nothing is sent (an id hit on the first
    token); the first delta moves both."""
    r = Run(BL, stop_token_ids=((204,),))
    assert r.proc.sent_mark == (0, 0)
    assert r.feed([204]) is FinishReason.STOP_SEQUENCE
    assert r.proc.sent_mark == (0, 0)
    r = Run(BL)
    assert r.feed([201]) is None and r.proc.sent_mark == (1, 1)


def test_issue23_a_first_token_that_is_not_an_opener_id_starts_the_answer() -> None:
    """Issue 23, S2: with the opener's ids known, the first token decides: "<th" (not the
    opener id) is answer from its first byte and is sent at once, not held as a possible
    ``<think>``; nothing is reasoning and no split is recorded."""
    r = Run(BL, reasoning=ReasoningSpec(close_ids=(CLOSE_ID,), open_ids=(OPEN_ID,)))
    assert r.feed([205]) is None
    assert (r.text(reasoning=True), r.text()) == (b"", b"<th")
    assert r.proc.reasoning_split() is None


def test_issue23_g2_opener_ids_only_while_a_block_may_still_open() -> None:
    """Issue 23, G2: the opener's ids are offered to a grammar's mask (``opener_ids``) only
    while the output's first token may open a reasoning block: never without a reasoning
    split, and no more once a token came."""
    assert Run(BL).proc.opener_ids() == ()
    spec = ReasoningSpec(inside=False, close_ids=(CLOSE_ID,), open_ids=(OPEN_ID,))
    r = Run(BL, reasoning=spec)
    assert r.proc.opener_ids() == (OPEN_ID,)
    r.feed([201])
    assert r.proc.opener_ids() == ()
