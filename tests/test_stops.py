"""Tests of coda.stops: stop strings on the byte stream, stop token-id sequences (S1–S4, G2).

The hypothesis properties compare the streaming matcher with a brute-force oracle that sees the
whole output at once and applies the S4 tie rule literally.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda import stops_automaton
from coda.errors import InvalidRequestError
from coda.output import OutputSpec
from coda.stops import (
    STOP_RULE_VERSION,
    StopHit,
    StopMatcherClosed,
    StopStringMatcher,
    stop_bytes,
)
from coda.stops_ids import StopTokenMatcher
from tests.conftest import examples
from tests.reference_loop import generate
from tests.scripted import ScriptedChooser, ScriptedModel, scripted_tokenizer

# ---------------------------------------------------------------- brute-force oracles


def oracle_first_hit(text: bytes, stops: Sequence[bytes]) -> tuple[int, int, int] | None:
    """(index, start, end) of the S4 winner: earliest end, then longest, then config order."""
    for end in range(1, len(text) + 1):
        cands = [(-len(s), i) for i, s in enumerate(stops) if text[:end].endswith(s)]
        if cands:
            neg_len, index = min(cands)
            return index, end + neg_len, end
    return None


def oracle_holdback(text: bytes, stops: Sequence[bytes]) -> int:
    """Longest suffix of ``text`` that is a prefix of some stop (S2 minimal holdback)."""
    for k in range(len(text), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


def oracle_tokens(ids: Sequence[int], seqs: Sequence[Sequence[int]]) -> tuple[int, int, int] | None:
    for end in range(1, len(ids) + 1):
        cands = [(-len(q), i) for i, q in enumerate(seqs)
                 if len(q) <= end and list(ids[end - len(q):end]) == list(q)]
        if cands:
            neg_len, index = min(cands)
            return index, end + neg_len, end
    return None


def stream(m: StopStringMatcher, pieces: Sequence[bytes]) -> tuple[bytes, StopHit | None]:
    out = b""
    for p in pieces:
        safe, hit = m.push(p)
        out += safe
        if hit is not None:
            return out, hit
    return out + m.flush(), None


# ---------------------------------------------------------------- fixtures and examples


def test_s2_e1_fixture_bcd_holds_b_then_hits() -> None:
    """S2/E1: 101->"AB", 102->"CD", stop "BCD": "A" sent, then the hit sends nothing."""
    m = StopStringMatcher(["BCD"])
    assert m.push(b"AB") == (b"A", None)
    assert m.held == b"B"
    safe, hit = m.push(b"CD")
    assert safe == b""
    assert hit == StopHit("string", 0, "BCD", 1, 4)
    assert m.hit == hit and m.emitted_bytes == 1
    assert m.discard() == b""


def test_s2_minimal_holdback_releases_when_prefix_breaks() -> None:
    m = StopStringMatcher(["BCD", "xyz"])
    assert m.push(b"ABC") == (b"A", None)
    assert m.held == b"BC"
    assert m.push(b"E") == (b"BCE", None)
    assert m.held == b""
    assert m.push(b"xx") == (b"x", None)  # "x" then a fresh "x": only the last is a prefix
    assert m.flush() == b"x"
    assert m.emitted_bytes == 6


def test_s4_earliest_end_beats_longer_later() -> None:
    """S4: "bc" ends at 3, "abcd" at 4: the earlier end wins even though it is shorter."""
    text = b"xabcd"
    out, hit = stream(StopStringMatcher(["abcd", "bc"]), [text])
    assert out == b"xa" and hit is not None and (hit.stop, hit.index, hit.start, hit.end) == (
        "bc", 1, 2, 4)
    assert oracle_first_hit(text, [b"abcd", b"bc"]) == (1, 2, 4)


def test_s4_same_end_longest_wins() -> None:
    for stops in (["cd", "bcd", "d"], ["d", "bcd", "cd"]):
        m = StopStringMatcher(stops)
        safe, hit = m.push(b"abcd")
        assert safe == b"a" and hit is not None and hit.stop == "bcd"
        assert hit.index == stops.index("bcd")


def test_s4_identical_stops_config_order() -> None:
    _, hit = StopStringMatcher(["zz", "ab", "ab"]).push(b"xab")
    assert hit is not None and (hit.index, hit.start, hit.end) == (1, 1, 3)
    assert STOP_RULE_VERSION == "2"


def test_s2_overlapping_stops_abcd_vs_bc_split() -> None:
    """S2/S4: "abc" is held as a prefix of "abcd" while "bc" completes inside it."""
    m = StopStringMatcher(["abcd", "bc"])
    assert m.push(b"ab") == (b"", None)
    assert m.held == b"ab"
    safe, hit = m.push(b"cd")
    assert safe == b"a" and hit is not None and hit.stop == "bc"
    assert m.tail_after_hit == b"d"


def test_s2_multibyte_utf8_stop_split_across_pushes() -> None:
    stop = "終了"  # six bytes
    data = "前文終了後".encode()
    m = StopStringMatcher([stop])
    out = b""
    for i in range(len(data)):
        safe, hit = m.push(data[i:i + 1])
        out += safe
        if hit:
            break
    assert out.decode() == "前文"
    assert hit is not None and hit.start == 6 and hit.end == 12


def test_s2_multibyte_near_miss_releases_whole_char() -> None:
    m = StopStringMatcher(["é"])  # c3 a9
    assert m.push(b"\xc3") == (b"", None)
    assert m.push(b"\xaa") == ("ê".encode(), None)  # c3 aa: same lead byte, released whole


def test_s3_include_stop_in_output() -> None:
    m = StopStringMatcher(["BCD"], include_stop_in_output=True)
    assert m.push(b"AB") == (b"A", None)
    safe, hit = m.push(b"CDEF")
    assert safe == b"BCD" and hit is not None
    assert m.emitted_bytes == 4 and m.tail_after_hit == b"EF"
    assert m.dropped_bytes == 2 and m.consumed_bytes == 6


def test_s3_hit_is_absorbing_push_raises() -> None:
    m = StopStringMatcher(["x"])
    m.push(b"ax")
    with pytest.raises(StopMatcherClosed):
        m.push(b"more")
    assert isinstance(StopMatcherClosed("x"), RuntimeError)
    snap = m.snapshot()
    assert snap["closed"] is True and snap["hit"] == {
        "kind": "string", "index": 0, "stop": "x", "start": 1, "end": 2, "rule_version": "2"}


def test_issue20_d6_s3_unarmed_hit_state_then_armed_pushes_with_one_stop() -> None:
    """Issue 20 D6 (S1, S3): with one stop the matcher's only hit state is its first; a stop
    completed unarmed (before min_tokens) leaves it there, and the next armed push must leave
    it byte by byte (no hit on "x") and must end at the next occurrence."""
    m = StopStringMatcher(["ab"])
    assert m.push(b"xab", armed=False) == (b"xab", None)
    assert m.push(b"x") == (b"x", None)
    m2 = StopStringMatcher(["ab"])
    assert m2.push(b"ab", armed=False) == (b"ab", None)
    safe, hit = m2.push(b"cab")
    assert safe == b"c" and hit is not None and (hit.start, hit.end) == (3, 5)
    m3 = StopStringMatcher(["aba"])  # the unarmed match's tail starts the armed one
    assert m3.push(b"aba", armed=False) == (b"ab", None)
    safe, hit = m3.push(b"ba")
    assert safe == b"" and hit is not None and (hit.start, hit.end) == (2, 5)


def test_g2_finish_tail_can_hit_and_flush_releases_on_normal_end() -> None:
    """G2: the detokenizer's finish() bytes pass through the matcher and may hit; else flush."""
    m = StopStringMatcher(["END"])
    assert m.push(b"text E") == (b"text ", None)
    safe, hit = m.push(b"ND")  # what finish() drained
    assert safe == b"" and hit is not None
    assert m.discard() == b""  # after a hit: discard, never flush
    m2 = StopStringMatcher(["END"])
    assert m2.push(b"text EN") == (b"text ", None)
    assert m2.flush() == b"EN"  # normal end: the held suffix matched nothing
    with pytest.raises(StopMatcherClosed):
        m2.push(b"D")


def test_g2_cancel_discard_drops_held() -> None:
    m = StopStringMatcher(["END"])
    m.push(b"abE")
    snap = m.snapshot()
    assert snap["depth"] == 1 and snap["held_hex"] == "45"
    assert m.discard() == b"E" and m.emitted_bytes == 2


def test_s1_no_stops_passthrough_and_empty_push() -> None:
    m = StopStringMatcher([])
    assert m.push(b"anything") == (b"anything", None)
    assert m.flush() == b"" and m.emitted_bytes == 8
    m2 = StopStringMatcher(["q"])
    assert m2.push(b"") == (b"", None)


def test_s1_empty_stop_rejected() -> None:
    with pytest.raises(InvalidRequestError) as err:
        StopStringMatcher(["ok", ""])
    assert err.value.field == "stop"
    with pytest.raises(InvalidRequestError) as err2:
        StopTokenMatcher([[1], []])
    assert err2.value.field == "stop_token_ids"


def test_s1_token_sequences_kmp_overlap() -> None:
    """S1: [1,1,2] on 1,1,1,2 must hit at the end (a naive restart would miss it)."""
    m = StopTokenMatcher([[1, 1, 2]])
    assert [m.push(t) for t in (1, 1, 1)] == [None, None, None]
    assert m.depth == 2
    assert m.push(2) == StopHit("token_ids", 0, (1, 1, 2), 1, 4)
    with pytest.raises(StopMatcherClosed):
        m.push(5)


def test_s4_token_tie_rule() -> None:
    m = StopTokenMatcher([[7, 8, 9], [8, 9], [8], [9]])
    assert m.push(7) is None
    hit = m.push(8)
    assert hit is not None and hit.stop == (8,)  # earliest end
    m2 = StopTokenMatcher([[9], [7, 9], [5, 7, 9], [5, 7, 9]])
    for t in (5, 7):
        assert m2.push(t) is None
    hit2 = m2.push(9)
    assert hit2 is not None and (hit2.index, hit2.start, hit2.end) == (2, 0, 3)


def test_s1_token_matcher_without_sequences() -> None:
    m = StopTokenMatcher([])
    assert all(m.push(t) is None for t in range(100))
    assert m.snapshot()["tokens"] == 100


# ---------------------------------------------------------------- properties

ALPHABET = "abé"  # small, with a two-byte character so hits and UTF-8 splits both happen
texts = st.text(alphabet=ALPHABET, max_size=40).map(str.encode)
stop_sets = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=5)


@st.composite
def split(draw: st.DrawFn, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=12)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(deadline=None, max_examples=examples(200))
@given(st.data(), texts, stop_sets, st.booleans())
def test_s2_s3_s4_streamed_equals_oracle_properties(
        data: st.DataObject, text: bytes, stops: list[str], include: bool) -> None:
    """S2–S4 properties: (1) streamed == oracle, (2) nothing emitted contains a stop,
    (3) holdback minimal after every push, (4) emitted + held == input before a hit."""
    bstops = [s.encode() for s in stops]
    pieces = data.draw(split(text))
    m = StopStringMatcher(stops, include_stop_in_output=include)
    out, seen, hit = b"", b"", None
    for p in pieces:
        safe, hit = m.push(p)
        out += safe
        assert m.consumed_bytes == len(seen) + len(p)
        assert m.consumed_bytes == m.emitted_bytes + m.dropped_bytes + len(m.held)
        if hit is not None:
            break
        seen += p
        assert m.held == seen[len(seen) - oracle_holdback(seen, bstops):]  # (3)
        assert out + m.held == seen  # (4)
        assert not any(s in out for s in bstops)  # (2)
    if hit is None:
        out += m.flush()
    expected = oracle_first_hit(text, bstops)
    if expected is None:
        assert hit is None and out == text
    else:
        index, start, end = expected
        assert hit is not None and (hit.index, hit.start, hit.end) == (index, start, end)
        assert out == (text[:end] if include else text[:start])  # (1)
        assert not any(s in out[:start] for s in bstops)  # (2)
    assert m.emitted_bytes == len(out)


@settings(deadline=None, max_examples=examples(200))
@given(st.lists(st.integers(0, 2), max_size=30),
       st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4), min_size=1, max_size=4))
def test_s1_s4_token_sequences_match_oracle(ids: list[int], seqs: list[list[int]]) -> None:
    m = StopTokenMatcher(seqs)
    got = None
    for t in ids:
        got = m.push(t)
        if got is not None:
            break
    expected = oracle_tokens(ids, seqs)
    if expected is None:
        assert got is None
    else:
        assert got is not None and (got.index, got.start, got.end) == expected
        assert got.stop == tuple(seqs[expected[0]])


@pytest.mark.parametrize("bad", ["\ud800", "ok\udfff", "a\ud83d"])
def test_s1_stop_with_a_lone_surrogate_is_an_invalid_request(bad: str) -> None:
    """S1 (issue 8 defect 9): a stop string with no UTF-8 form is InvalidRequestError naming
    the field, from the matcher and from the reference loop, never a UnicodeEncodeError."""
    with pytest.raises(InvalidRequestError) as e:
        StopStringMatcher(["fine", bad])
    assert e.value.field == "stop"
    with pytest.raises(InvalidRequestError) as e:
        stop_bytes(bad, "stop_sequences")
    assert e.value.field == "stop_sequences"
    tok = scripted_tokenizer({101: b"AB"})
    spec = OutputSpec(max_tokens=3, stop_strings=(bad,))
    with pytest.raises(InvalidRequestError) as e:
        generate([1], spec, ScriptedModel([101, 101, 101]), ScriptedChooser(), tok)
    assert e.value.field == "stop"


def test_s2_s3_discard_drops_the_held_suffix_accounts_for_it_and_closes() -> None:
    """S2, S3, G2: discard() returns and drops the held bytes (consumed = emitted + dropped +
    held stays true), and the matcher then refuses output."""
    m = StopStringMatcher(["xyz"])
    assert m.push(b"abxy") == (b"ab", None) and m.held == b"xy"
    assert m.discard() == b"xy"
    assert (m.emitted_bytes, m.dropped_bytes, m.held, m.consumed_bytes) == (2, 2, b"", 4)
    assert m.closed
    with pytest.raises(StopMatcherClosed):
        m.push(b"z")
    f = StopStringMatcher(["xyz"])
    f.push(b"axy")
    assert f.flush() == b"xy" and (f.emitted_bytes, f.dropped_bytes) == (3, 0) and f.closed


@pytest.mark.parametrize("bad", [[[-1]], [[3, -2]], [["7"]], [[]], [[1.0]]])
def test_s1_stop_token_sequences_must_be_non_negative_int_ids(bad: list[list[object]]) -> None:
    """S1: every id of a stop sequence is a non-negative int, else a typed invalid request."""
    with pytest.raises(InvalidRequestError) as e:
        StopTokenMatcher(bad)  # type: ignore[arg-type]
    assert e.value.field == "stop_token_ids"


def test_s1_a_broken_partial_id_match_restarts_from_scratch() -> None:
    """S1: (1, 2) must match adjacent ids only: 1, 5, 2 is no match; the failed partial match
    resets the depth to 0, and 1, 2 afterwards still hits with its stream offsets."""
    m = StopTokenMatcher([(1, 2)])
    assert m.push(1) is None and m.depth == 1
    assert m.push(5) is None and m.depth == 0
    assert m.push(2) is None and m.depth == 0
    assert m.push(1) is None and m.depth == 1
    hit = m.push(2)
    assert hit is not None and (hit.start, hit.end, hit.index) == (3, 5, 0)


def test_s3_discard_after_a_hit_keeps_the_drop_count() -> None:
    """S3, G2: after a hit, discard() (what the DRAINING step calls) drops nothing more and
    keeps the count of what the hit dropped: consumed = emitted + dropped still holds."""
    m = StopStringMatcher(["cd"])
    safe, hit = m.push(b"abcdef")
    assert safe == b"ab" and hit is not None and m.dropped_bytes == 4
    assert m.discard() == b"" and m.dropped_bytes == 4
    assert m.consumed_bytes == 6 == m.emitted_bytes + m.dropped_bytes


def test_s2_a_failed_partial_match_returns_to_the_root_state() -> None:
    """S2: after "a" (a prefix of "ab") a byte that continues no stop leaves no held bytes, so
    "axb" never hits "ab"; the fresh matcher is open with no tail; a hit records what came
    after the stop in its push (dropped, K2)."""
    m = StopStringMatcher(["ab"])
    assert not m.closed and m.tail_after_hit == b"" and m.held == b""
    assert m.push(b"axb") == (b"axb", None) and m.held == b""
    assert m.push(b"za") == (b"z", None) and m.held == b"a"
    assert m.push(b"q") == (b"aq", None)
    safe, hit = m.push(b"xabyz")
    assert safe == b"x" and hit is not None and m.tail_after_hit == b"yz"


@pytest.fixture(autouse=True)
def _fresh_automata() -> None:
    """Each test compiles its stop automata itself: the compile cache must not carry an
    automaton built earlier in the session past a defect in building one (S1-S4)."""
    stops_automaton.compile_bytes.cache_clear()
    stops_automaton.compile_tokens.cache_clear()


def test_s2_s4_failure_links_follow_a_shorter_stop_inside_a_longer_one() -> None:
    """S2, S4: "abce" must hit "bce" although "abc" was on the way to "abcd" (the failure link
    of "abc" is "bc"); "abbc" must not hit "abc" (the failure link of "ab" is the root)."""
    safe, hit = StopStringMatcher(["abcd", "bce"]).push(b"xabce")
    assert hit is not None and hit.stop == "bce" and safe == b"xa"
    assert StopStringMatcher(["abc"]).push(b"abbc") == (b"abbc", None)
    tokens = StopTokenMatcher([(1, 2, 3, 4), (2, 3, 5)])
    assert [tokens.push(t) for t in (1, 2, 3)] == [None, None, None]
    hit = tokens.push(5)
    assert hit is not None and hit.index == 1 and (hit.start, hit.end) == (1, 4)
