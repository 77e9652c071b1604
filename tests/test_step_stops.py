"""Stop strings and stop token-id sequences together, against a brute-force oracle
(SPEC S1–S4, T2, L6; issue 8 defects 2 and 3), through the reference loop on a scripted model.

The oracle re-reads the whole output after every selected token: an id sequence that is a
suffix of the ids ends the request there (longest, then configuration order), its text never
shown; otherwise the earliest-ending stop string in the visible bytes ends it (then longest,
then configuration order). Earliest end is counted in selected tokens; at the same token the
id sequence wins (it is checked first in the G1 order). No token is selected after the stop.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from coda import trace as tr
from coda.finish import FinishReason
from coda.output import OutputSpec
from coda.trace import ListTraceSink, check_trace
from tests.reference_loop import generate
from tests.scripted import EOS_ID, ScriptedChooser, ScriptedModel, scripted_tokenizer

TABLE = {101: b"a", 102: b"b", 103: b"ab", 104: b"ba", 105: b"c", 106: b"bc", 107: b"AB",
         108: b"CD", 109: b"EF"}
TOK = scripted_tokenizer(TABLE)
IDS = sorted(TABLE)


def _run(script: list[int], strings: tuple[str, ...], id_seqs: tuple[tuple[int, ...], ...],
         include: bool = False, min_tokens: int = 0
         ) -> tuple[bytes, FinishReason, object, int, int]:
    sink = ListTraceSink()
    spec = OutputSpec(max_tokens=1000, eos_token_ids=frozenset({EOS_ID}), stop_strings=strings,
                      stop_token_ids=id_seqs, include_stop_str_in_output=include,
                      min_tokens=min_tokens)
    run = generate([1], spec, ScriptedModel(script + [EOS_ID]), ScriptedChooser(), TOK,
                   trace=sink)
    assert check_trace(sink.events) == []
    term = run.stream.terminal
    assert term is not None
    selected = sum(e.kind == tr.TOKEN_SELECTED for e in sink.events)
    assert selected == term.usage.selected_tokens  # T2: nothing chosen past the end
    stop = (term.stop.kind, term.stop.index) if term.stop is not None else None
    return (run.stream.text().encode(), term.finish_reason, stop, selected,
            term.usage.returned_tokens)


def _oracle(script: list[int], strings: tuple[str, ...], id_seqs: tuple[tuple[int, ...], ...],
            include: bool = False, min_tokens: int = 0
            ) -> tuple[bytes, FinishReason, object, int, int]:
    """With ``min_tokens`` (issue 20 D6) a stop counts only if it completes at a token
    t >= min_tokens: an id sequence that is a suffix of ids[:t], or a string occurrence whose
    last byte is one of token t's bytes (it may begin in earlier tokens: a straddling stop)."""
    texts = [TABLE[i] for i in script]

    def returned(out: bytes, upto: int) -> int:  # L6: tokens whose first byte was sent
        off, n = 0, 0
        for data in texts[:upto]:
            n += bool(data) and off < len(out)
            off += len(data)
        return n

    for t in range(max(1, min_tokens), len(script) + 1):
        ids = script[:t]
        id_hits = [(-len(seq), idx) for idx, seq in enumerate(id_seqs)
                   if len(seq) <= t and tuple(ids[t - len(seq):]) == seq]
        if id_hits:
            neg_len, idx = min(id_hits)
            out = b"".join(texts[: t + neg_len])
            return out, FinishReason.STOP_SEQUENCE, ("token_ids", idx), t, returned(out, t)
        stream = b"".join(texts[:t])
        before = len(stream) - len(texts[t - 1])  # NOTE: ends at or before: earlier tokens
        found = []
        for idx, s in enumerate(strings):
            for pos in range(len(stream) - len(s) + 1):
                if pos + len(s) > before and stream.startswith(s.encode(), pos):
                    found.append((pos + len(s), -len(s), idx, pos))
        if found:
            end, _, idx, pos = min(found)
            out = stream[: end if include else pos]
            return out, FinishReason.STOP_SEQUENCE, ("string", idx), t, returned(out, t)
    out = b"".join(texts)
    return out, FinishReason.EOS, None, len(script) + 1, returned(out, len(script))


def test_s1_s3_stop_id_hit_keeps_text_held_for_another_sequence() -> None:
    """S1, S3 (defect 2): 108 ("CD") is held as a possible start of (108, 109); 107 then hits
    (107,): the held "CD" came before the hit and is returned, not dropped."""
    got = _run([108, 107], (), ((108, 109), (107,)))
    assert got[:3] == (b"CD", FinishReason.STOP_SEQUENCE, ("token_ids", 1))
    assert got == _oracle([108, 107], (), ((108, 109), (107,)))


def test_s4_t2_l6_string_inside_held_ids_ends_first() -> None:
    """S4, T2, L6 (defect 3): stop "B" and ids (107, 108, 109); 107 = "AB". "B" ends at token 1,
    so the answer is "A" ending on "B", and no token after 107 is selected."""
    text, reason, stop, selected, returned = _run([107, 108, 109], ("B",), ((107, 108, 109),))
    assert (text, reason, stop) == (b"A", FinishReason.STOP_SEQUENCE, ("string", 0))
    assert selected == 1 and returned == 1


def test_s4_same_token_id_sequence_wins_over_string() -> None:
    """S4 across kinds: both complete at token 3; the id sequence is checked first (G1)."""
    got = _run([107, 108, 109], ("DEF",), ((108, 109),))
    assert got[:4] == (b"AB", FinishReason.STOP_SEQUENCE, ("token_ids", 0), 3)


_stop_strings = st.lists(st.text(alphabet="abcABCD", min_size=1, max_size=3), max_size=3)
_id_seqs = st.lists(st.lists(st.sampled_from(IDS), min_size=1, max_size=3).map(tuple),
                    max_size=3)


@given(st.lists(st.sampled_from(IDS), max_size=14), _stop_strings, _id_seqs, st.booleans())
def test_s1_s2_s3_s4_t2_l6_mixed_stops_equal_brute_force(
        script: list[int], strings: list[str], seqs: list[tuple[int, ...]], include: bool
) -> None:
    """S1–S4, T2, L6: for all scripts and any mix of stop strings and id sequences, the text,
    reason, matched stop, selected and returned token counts equal the brute-force oracle."""
    got = _run(script, tuple(strings), tuple(seqs), include)
    assert got == _oracle(script, tuple(strings), tuple(seqs), include)


@given(st.lists(st.sampled_from(IDS), max_size=14), _id_seqs)
def test_s1_s3_id_sequences_alone_equal_brute_force(
        script: list[int], seqs: list[tuple[int, ...]]) -> None:
    """S1, S3, S4 (defect 2): the id path alone equals the oracle for any set of sequences."""
    assert _run(script, (), tuple(seqs)) == _oracle(script, (), tuple(seqs))


def _sent_after_each_token(script: list[int], strings: tuple[str, ...],
                           id_seqs: tuple[tuple[int, ...], ...],
                           min_tokens: int = 0) -> list[bytes]:
    """The text sent once each token was processed, read from the trace's deltas."""
    sink = ListTraceSink()
    spec = OutputSpec(max_tokens=1000, eos_token_ids=frozenset({EOS_ID}), stop_strings=strings,
                      stop_token_ids=id_seqs, min_tokens=min_tokens)
    generate([1], spec, ScriptedModel(script + [EOS_ID]), ScriptedChooser(), TOK, trace=sink)
    sent, out = b"", []
    for e in sink.events:
        if e.kind == tr.TOKEN_SELECTED and e.data["t"] > 1:
            out.append(sent)
        elif e.kind == tr.STREAM_DELTA:
            sent += str(e.data["text"]).encode()
    return out


@given(st.lists(st.sampled_from(IDS), max_size=10), _stop_strings, _id_seqs)
def test_s2_s1_each_token_sends_exactly_what_no_stop_can_still_claim(
        script: list[int], strings: list[str], seqs: list[tuple[int, ...]]) -> None:
    """S2, S1: after each token that does not end the request, the bytes sent are the whole
    output minus (a) its longest suffix that is a proper prefix of a stop string and (b) the
    text of the ids that may still start a stop id sequence -- no more, and no less."""
    _check_sends(script, tuple(strings), tuple(seqs), 0)


@given(st.lists(st.sampled_from(IDS), max_size=10), _stop_strings, _id_seqs, st.integers(0, 8))
def test_issue20_d6_s2_min_tokens_sends_exactly_what_no_stop_can_still_claim(
        script: list[int], strings: list[str], seqs: list[tuple[int, ...]], min_tokens: int
) -> None:
    """Issue 20 D6 (S2): before min_tokens a completed stop is text and is sent, except its
    suffix that may still begin a stop that completes later (a straddling stop)."""
    _check_sends(script, tuple(strings), tuple(seqs), min_tokens)


def _check_sends(script: list[int], strings_t: tuple[str, ...],
                 seqs_t: tuple[tuple[int, ...], ...], min_tokens: int) -> None:
    end = _oracle(script, strings_t, seqs_t, min_tokens=min_tokens)[3]
    got = _sent_after_each_token(script, strings_t, seqs_t, min_tokens)
    for t in range(1, min(end, len(script) + 1)):
        if t == end:
            break
        stream = b"".join(TABLE[i] for i in script[:t])
        held = max([k for s in strings_t for k in range(1, len(s))
                    if stream.endswith(s.encode()[:k])], default=0)
        ids = script[:t]
        depth = max([k for q in seqs_t for k in range(1, len(q))
                     if k <= t and tuple(ids[t - k:]) == q[:k]], default=0)
        boundary = len(b"".join(TABLE[i] for i in script[: t - depth]))
        assert got[t - 1] == stream[: min(len(stream) - held, boundary)], t


def test_issue20_d6_s1_s3_min_tokens_holds_stops_until_token_min_tokens() -> None:
    """Issue 20 D6 (S1, S3): stop "B" would end at token 1 and ids (108,) at token 2; with
    ``min_tokens: 3`` both are ordinary output, and stop "A" ends the output at token 3."""
    script = [107, 108, 107, 109]
    got = _run(script, ("B", "A"), ((108,),), min_tokens=3)
    assert got[:4] == (b"ABCD", FinishReason.STOP_SEQUENCE, ("string", 1), 3)
    assert _run(script, ("B",), ((108,),), min_tokens=12)[:2] == (b"ABCDABEF", FinishReason.EOS)


def test_issue20_d6_s2_straddling_stop_string_ends_at_min_tokens() -> None:
    """Issue 20 D6 (S2, S4): stop "DA" begins in token 2 ("CD") and completes in token 3
    ("AB"): with ``min_tokens: 3`` it completes at token 3, so it ends the output there and
    none of its bytes are shown ("C"); with ``min_tokens: 4`` it is text."""
    script = [107, 108, 107, 109]
    assert _run(script, ("DA",), (), min_tokens=3)[:4] == (
        b"ABC", FinishReason.STOP_SEQUENCE, ("string", 0), 3)
    assert _run(script, ("DA",), (), min_tokens=4)[:2] == (b"ABCDABEF", FinishReason.EOS)


@given(st.lists(st.sampled_from(IDS), max_size=12), _stop_strings, _id_seqs, st.booleans(),
       st.integers(0, 8))
def test_issue20_d6_s1_s4_min_tokens_mixed_stops_equal_brute_force(
        script: list[int], strings: list[str], seqs: list[tuple[int, ...]], include: bool,
        min_tokens: int) -> None:
    """Issue 20 D6 (S1-S4, T2, L6): for all scripts, stops and ``min_tokens``, the text,
    reason, matched stop, selected and returned counts equal the oracle, where a stop counts
    only when it completes at a token t >= min_tokens."""
    got = _run(script, tuple(strings), tuple(seqs), include, min_tokens)
    assert got == _oracle(script, tuple(strings), tuple(seqs), include, min_tokens)
