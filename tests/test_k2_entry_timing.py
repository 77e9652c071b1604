"""When a token's logprob entry is sent (SPEC K2, S2, S3): with the delta that sends its LAST
shown byte, so the entries, concatenated in order, are the text at every point of the stream
and at the end, also when a stop string starts inside a token whose first bytes were already
sent (``".\\n"`` then ``"\\n"``, stop ``"\\n\\n"``: the ``"."`` goes out at once, S2; the
token's entry, cut to ``"."``, is the terminal's first trailing token, ``trailing_shown``)."""

from __future__ import annotations

import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.output import OutputProcessor
from coda.server.logprobs import chat_entries, reported_trailing
from coda.stream import EventType, RequestStream, TokenInfo
from coda.trace import NullTraceSink
from tests.scripted import output_spec, scripted_tokenizer

SPECIAL = b"<|s|>"


def _tokenizer(pieces: list[bytes]) -> tuple[tokenizers.Tokenizer, dict[bytes, int], int]:
    """A scripted byte-level tokenizer over ``pieces`` plus one special token."""
    ids = {p: 101 + i for i, p in enumerate(dict.fromkeys(pieces))}
    tok = scripted_tokenizer({i: p for p, i in ids.items()})
    tok.add_special_tokens([tokenizers.AddedToken(SPECIAL.decode(), special=True)])
    special = tok.token_to_id(SPECIAL.decode())
    assert special is not None
    return tok, ids, special


def _run(pieces: list[bytes | None], stops: tuple[str, ...], skip: bool, include: bool = False,
         stop_ids: tuple[tuple[int, ...], ...] = ()
         ) -> tuple[list[tuple[bytes, tuple[TokenInfo, ...]]], Terminal, list[int]]:
    """Feed ``pieces`` (None: the special token) through a processor until it ends; returns
    the deltas (bytes, tokens), the terminal and the ids selected."""
    tok, ids, special = _tokenizer([p for p in pieces if p is not None])
    script = [special if p is None else ids[p] for p in pieces]
    stream = RequestStream("r")
    spec = output_spec(stop_strings=stops, skip_special_tokens=skip, max_tokens=len(script),
                       include_stop_str_in_output=include,
                       stop_token_ids=tuple(tuple(script[i] for i in s) for s in stop_ids))
    proc = OutputProcessor("r", tok, spec, stream, NullTraceSink())
    reason, selected = None, []
    for i, p in zip(script, pieces, strict=True):
        selected.append(i)
        info = TokenInfo(i, -0.5, piece=SPECIAL if p is None else p, special=p is None)
        reason = proc.on_token(i, info)
        if reason is not None:
            break
    assert reason is not None
    reason = proc.drain(reason)
    terminal = Terminal(State.FINISHED, reason, Usage(), stop=proc.hit,
                        trailing_tokens=proc.trailing_tokens(),
                        trailing_shown=proc.trailing_shown)
    deltas = [(e.data, e.tokens) for e in stream.events_after(-1) if e.type is EventType.DELTA]
    return deltas, terminal, selected


def _run_timed(pieces: list[bytes | None], stops: tuple[str, ...], skip: bool,
               include: bool = False) -> list[tuple[bytes, tuple[TokenInfo, ...], int]]:
    """Like :func:`_run` without stop ids: each delta, its tokens and the number of tokens
    selected when it was sent."""
    tok, ids, special = _tokenizer([p for p in pieces if p is not None])
    stream = RequestStream("r")
    spec = output_spec(stop_strings=stops, skip_special_tokens=skip, max_tokens=len(pieces),
                       include_stop_str_in_output=include)
    proc = OutputProcessor("r", tok, spec, stream, NullTraceSink())
    out: list[tuple[bytes, tuple[TokenInfo, ...], int]] = []

    def take(n: int) -> None:
        evs = [e for e in stream.events_after(-1) if e.type is EventType.DELTA]
        out.extend((e.data, e.tokens, n) for e in evs[len(out):])

    reason, n = None, 0
    for p in pieces:
        i, n = special if p is None else ids[p], n + 1
        reason = proc.on_token(i, TokenInfo(i, -0.5, piece=SPECIAL if p is None else p,
                                            special=p is None))
        take(n)
        if reason is not None:
            break
    assert reason is not None
    proc.drain(reason)
    take(n)
    return out


def _entry_bytes(tokens: tuple[TokenInfo, ...], skip: bool) -> bytes:
    return b"".join(bytes(e["bytes"]) for e in chat_entries(tokens, skip_special=skip))


def _check(deltas: list[tuple[bytes, tuple[TokenInfo, ...]]], terminal: Terminal,
           selected: list[int], skip: bool) -> bytes:
    """The K2 entry rules; returns the text."""
    text, shown = b"", b""
    for data, tokens in deltas:
        text += data
        shown += _entry_bytes(tokens, skip)
        # NOTE: no entry before all its bytes were sent: the entries are a prefix of the text
        assert text.startswith(shown)
    reported = reported_trailing(terminal)
    shown += _entry_bytes(reported, skip)
    assert shown == text  # NOTE: K2: the entries reassemble the text
    carried = [t.token_id for _, ts in deltas for t in ts]
    # NOTE: entries in order; every selected token is in a delta or the terminal (usage)
    assert carried + [t.token_id for t in terminal.trailing_tokens] == selected
    if terminal.stop is not None and terminal.stop.kind == "token_ids":
        # NOTE: S3: an id sequence's own tokens are never reported
        own = terminal.stop.end - terminal.stop.start
        assert len(carried) + len(reported) <= len(selected) - own
    assert len(reported) >= terminal.trailing_shown or terminal.finish_reason not in (
        FinishReason.STOP_SEQUENCE, FinishReason.EOS)
    return text


def test_k2_s3_a_stop_starting_inside_a_sent_token_cuts_its_entry_to_the_text() -> None:
    """The straddle: ``"A"``, ``".\\n"``, ``"\\n"`` with stop ``"\\n\\n"``: ``"."`` goes out
    with no entry (its token's ``"\\n"`` is held, S2), the text ends at ``"."`` (S3) and the
    token's entry ``"."`` is reported from the terminal; ``"\\n"`` is the stop's own."""
    deltas, terminal, selected = _run([b"A", b".\n", b"\n"], ("\n\n",), True)
    assert [(d, [t.piece for t in ts]) for d, ts in deltas] == [(b"A", [b"A"]), (b".", [])]
    assert (terminal.trailing_shown, [t.piece for t in terminal.trailing_tokens]) == (
        1, [b".", b"\n"])
    assert [t.piece for t in reported_trailing(terminal)] == [b"."]
    assert _check(deltas, terminal, selected, True) == b"A."


def test_k2_a_token_goes_with_the_delta_that_sends_its_last_byte() -> None:
    """S2, K2: the held ``"\\n"`` is released by ``"x"`` (no stop): ``".\\n"`` goes with that
    delta, not the one that sent ``"."``."""
    deltas, terminal, selected = _run([b".\n", b"x"], ("\n\n",), True)
    assert [(d, [t.piece for t in ts]) for d, ts in deltas] == [
        (b".", []), (b"\nx", [b".\n", b"x"])]
    assert _check(deltas, terminal, selected, True) == b".\nx"


def test_k2_an_id_sequence_stop_never_reports_its_ids() -> None:
    """S1, S3: stop ids (the special token twice): the text before them is all reported, the
    ids never, even the textless first one while ``"."``'s held ``"\\n"`` waits."""
    deltas, terminal, selected = _run([b".\n", None, None], ("\n\n",), True,
                                      stop_ids=((1, 2),))
    assert terminal.finish_reason is FinishReason.STOP_SEQUENCE
    assert [(d, [t.token_id for t in ts]) for d, ts in deltas] == [
        (b".", []), (b"\n", [selected[0]])]
    assert (terminal.trailing_shown, reported_trailing(terminal)) == (0, ())
    assert _check(deltas, terminal, selected, True) == b".\n"


# Pieces: a random text's bytes cut at random points (multi-byte characters split across
# tokens), the special token (None) anywhere.
_TEXT = st.text(alphabet=st.sampled_from(list("ab.\n é€😀")), min_size=1, max_size=14)


@st.composite
def _case(draw: st.DrawFn
          ) -> tuple[list[bytes | None], tuple[str, ...], bool, bool, tuple[int, ...]]:
    raw = draw(_TEXT).encode()
    cuts = sorted(set(draw(st.lists(st.integers(1, max(len(raw) - 1, 1)), max_size=10))))
    parts = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True) if raw[a:b]]
    text = raw.decode()
    # NOTE: the special token only between whole characters (kept inside a split one, the
    # text would hold U+FFFD, not the pieces)
    bounds = {len(text[:i].encode()) for i in range(len(text) + 1)}
    at = [i for i in range(len(parts) + 1) if sum(map(len, parts[:i])) in bounds]
    pieces: list[bytes | None] = list(parts)
    for i in sorted(draw(st.lists(st.sampled_from(at), max_size=2)), reverse=True):
        pieces.insert(i, None)
    stop = draw(st.one_of(st.text(alphabet=st.sampled_from(list("ab.\n é")), min_size=1,
                                  max_size=3),
                          st.tuples(st.integers(0, len(text)), st.integers(1, 3)).map(
                              lambda ab: text[ab[0]:ab[0] + ab[1]] or "a")))
    ids = draw(st.lists(st.integers(0, len(pieces) - 1), max_size=2))
    return pieces, (stop,), draw(st.booleans()), draw(st.booleans()), tuple(ids)


@settings(deadline=None, max_examples=300)
@given(_case())
def test_k2_entries_reassemble_the_text_for_all_pieces_and_stops(
        case: tuple[list[bytes | None], tuple[str, ...], bool, bool, tuple[int, ...]]) -> None:
    """For all token pieces (multi-byte characters split across tokens, a special token
    skipped or kept), stop strings, include_stop_str_in_output and a stop id sequence (of the
    script's ids): at every delta the entries sent are a prefix of the text sent (no entry
    before its last byte), and at the end the reported entries, in order, are exactly the
    text (K2, S1, S2, S3)."""
    pieces, stops, skip, include, ids = case
    deltas, terminal, selected = _run(pieces, stops, skip, include, (ids,) if ids else ())
    text = _check(deltas, terminal, selected, skip)
    whole = b"".join(SPECIAL if p is None else p for p in pieces if p is not None or not skip)
    if terminal.finish_reason is FinishReason.STOP_SEQUENCE:
        assert whole.startswith(text)
    else:
        assert text == whole


def test_k2_a_token_whose_piece_is_not_its_text_is_not_held_back() -> None:
    """K2: where a piece differs from the text the detokenizer gives (a SentencePiece first
    token ``"▁x"``: piece ``" x"``, text ``"x"``), the entry still goes with the delta that
    sent the token's text (the detokenizer held nothing after it), not at the end."""
    tok = scripted_tokenizer({101: b"x", 102: b"y"})
    stream = RequestStream("r")
    proc = OutputProcessor("r", tok, output_spec(max_tokens=3), stream, NullTraceSink())
    proc.on_token(101, TokenInfo(101, -0.5, piece=b" x"))
    proc.on_token(102, TokenInfo(102, -0.5, piece=b"y"))
    deltas = [(e.data, [t.token_id for t in e.tokens]) for e in stream.events_after(-1)
              if e.type is EventType.DELTA]
    assert deltas == [(b"x", [101]), (b"y", [102])]


@settings(deadline=None, max_examples=200)
@given(_case())
def test_k2_a_delta_carries_every_token_whose_last_byte_it_sends(
        case: tuple[list[bytes | None], tuple[str, ...], bool, bool, tuple[int, ...]]) -> None:
    """For all pieces and stop strings: after each delta but a stop's last one, the next token
    not yet reported (of those selected by then) is not wholly in the text sent: no entry
    waits past the delta that sends its last byte (K2; the stop's last delta cuts, S3)."""
    pieces, stops, skip, include, _ = case
    deltas = _run_timed(pieces, stops, skip, include)
    text, shown, reported = b"", b"", 0
    for k, (data, tokens, selected) in enumerate(deltas):
        text += data
        shown += _entry_bytes(tokens, skip)
        reported += len(tokens)
        if reported < selected and k < len(deltas) - 1:
            p = pieces[reported]
            nxt = b"" if p is None and skip else SPECIAL if p is None else p
            assert not text.startswith(shown + nxt)


def test_k2_the_timed_run_sees_every_delta() -> None:
    """The helper above: ``".\n"`` (``"."`` out, ``"\n"`` held) then ``"x"``."""
    assert _run_timed([b".\n", b"x"], ("\n\n",), True) == [
        (b".", (), 1), (b"\nx", (TokenInfo(101, -0.5, piece=b".\n"),
                                 TokenInfo(102, -0.5, piece=b"x")), 2)]


def test_s3_a_string_stop_while_ids_are_held_reports_the_held_textless_token() -> None:
    """S1, S3: stop ids (special, ``"\\n"``, ``"z"``) and stop string ``"\\n"``: at ``"\\n"``
    the string hits while the special and ``"\\n"`` are held as a partial id match; no id
    sequence completed, so the textless special is output before the stop and reported."""
    deltas, terminal, selected = _run([b"A", None, b"\n", b"z"], ("\n",), True,
                                      stop_ids=((1, 2, 3),))
    assert terminal.stop is not None and terminal.stop.kind == "string"
    assert [t.token_id for t in reported_trailing(terminal)] == [selected[1]]
    assert _check(deltas, terminal, selected, True) == b"A"


def test_s3_a_textless_token_after_the_cut_token_is_the_stops_own() -> None:
    """S3: stops ``"BCq"`` and ``"CD"``: ``"BC"`` is held, the special follows, ``"D"``
    completes ``"CD"``: the last delta sends ``"B"`` with ``"BC"`` cut to ``"B"``; the special
    (inside the stop) and ``"D"`` are the stop's own, never reported."""
    deltas, terminal, selected = _run([b"A", b"BC", None, b"D"], ("BCq", "CD"), True)
    assert [(d, [t.piece for t in ts]) for d, ts in deltas] == [(b"A", [b"A"]),
                                                              (b"B", [b"B"])]
    assert (terminal.trailing_shown, reported_trailing(terminal)) == (0, ())
    assert len(terminal.trailing_tokens) == 2
    assert _check(deltas, terminal, selected, True) == b"AB"


def test_s1_s3_a_held_id_is_not_reported_when_earlier_bytes_go_out() -> None:
    """S1, S3: stop ids (special, ``"x"``, ``"y"``) and stop string ``"\\n\\n"``: ``"x"``
    releases the held ``"\\n"`` while the special and ``"x"`` are a partial id match; the
    delta carries ``".\\n"`` only, and once ``"y"`` completes the ids none of them is
    reported."""
    deltas, terminal, selected = _run([b".\n", None, b"x", b"y"], ("\n\n",), True,
                                      stop_ids=((1, 2, 3),))
    assert [(d, [t.token_id for t in ts]) for d, ts in deltas] == [
        (b".", []), (b"\n", [selected[0]])]
    assert terminal.stop is not None and terminal.stop.kind == "token_ids"
    assert _check(deltas, terminal, selected, True) == b".\n"


def test_k2_the_durable_log_keeps_trailing_shown() -> None:
    """P3, K2: a replayed terminal (the stream log's v2 and v1 forms, the worker feed) still
    says which trailing tokens are text, so a resumed reader reports the same entries."""
    from coda.durable.codec import decode_event, encode_event, pack_event, unpack_events
    from coda.stream import StreamEvent

    _, terminal, _ = _run([b"A", b".\n", b"\n"], ("\n\n",), True)
    ev = StreamEvent("r", 3, EventType.TERMINAL, terminal=terminal)
    for back in (decode_event(encode_event(ev)), unpack_events("r", pack_event(ev))[0]):
        assert back.terminal is not None
        assert reported_trailing(back.terminal) == reported_trailing(terminal) != ()
