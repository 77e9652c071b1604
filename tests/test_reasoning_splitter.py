"""The reasoning splitter byte by byte against a brute-force oracle (issue 23; SPEC K2: what the
stream sends as reasoning and as answer reassembles exactly, the markers removed).

For all outputs and all ways of cutting them into pushes: the reasoning and answer bytes the
splitter releases (``push`` then ``finish``) equal the oracle's split of the whole output; after
every push it holds back exactly the longest tail that could still become a marker, never
more (so reasoning streams as early as it safely can); ``reasoning_bytes`` counts what it sent;
the terminal's record exists exactly when a block was opened (or the prompt opened one).
Short markers over a small alphabet make partial and overlapping markers common. A mutation
run of ``coda/reasoning.py`` (``scripts/mutation.sh reasoning``) found these untested."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coda.reasoning import ReasoningSpec, ReasoningSplitter
from tests.conftest import examples

OPEN, CLOSE = b"<a>", b"</a>"


def oracle(text: bytes, inside: bool) -> tuple[bytes, bytes, bytes, bytes]:
    """(reasoning, answer, opener, closer) of the whole output."""
    opener = b""
    if not inside:
        if not text.startswith(OPEN):
            return b"", text, b"", b""
        opener, text = OPEN, text[len(OPEN):]
    at = text.find(CLOSE)
    if at < 0:
        return text, b"", opener, b""
    return text[:at], text[at + len(CLOSE):], opener, CLOSE


def longest_marker_tail(data: bytes, marker: bytes) -> int:
    """The longest suffix of ``data`` that is a proper prefix of ``marker``."""
    return max((n for n in range(len(marker)) if data.endswith(marker[:n])), default=0)


_BYTES = st.lists(st.sampled_from([b"<", b"/", b"a", b">", b"x", b"<a>", b"</a>"]),
                  max_size=14).map(b"".join)


@settings(max_examples=examples(400), deadline=None)
@given(text=_BYTES, inside=st.booleans(), data=st.data())
def test_k2_pushes_in_any_cuts_reassemble_the_oracles_split(text: bytes, inside: bool,
                                                           data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    sp = ReasoningSplitter(ReasoningSpec(open=OPEN, close=CLOSE, inside=inside))
    reasoning = answer = b""
    seen = b""
    for chunk in chunks:
        r, a = sp.push(chunk)
        reasoning, answer, seen = reasoning + r, answer + a, seen + chunk
        want_r, _, _, closer = oracle(seen, inside)
        if sp.in_reasoning and not closer:
            # NOTE: released as early as safe: all but the tail that may begin the closer
            assert sp.held == longest_marker_tail(want_r, CLOSE)
            assert reasoning + seen[len(seen) - sp.held:] == want_r
    r, a = sp.finish()
    reasoning, answer = reasoning + r, answer + a
    want = oracle(text, inside)
    assert (reasoning, answer, sp.opener, sp.closer) == want
    assert sp.reasoning_bytes == len(reasoning) and sp.held == 0
    record = sp.split()
    assert (record is None) == (not inside and not want[2])
    if record is not None:
        assert (record.opener, record.reasoning_bytes, record.closer) == (
            want[2], len(want[0]), want[3])
        assert (record.forced, record.reasoning_tokens) == (False, 0)  # NOTE: the defaults


def test_k2_text_after_a_first_chunk_that_is_no_opener_stays_answer() -> None:
    """The opener counts only at the very start: once the output began otherwise, a later
    opener is answer text, and so is everything pushed after."""
    sp = ReasoningSplitter(ReasoningSpec(open=OPEN, close=CLOSE))
    assert sp.push(b"x") == (b"", b"x")
    assert sp.push(b"<a>y</a>") == (b"", b"<a>y</a>")
    assert sp.finish() == (b"", b"")
    assert sp.split() is None


def test_k2_a_partial_opener_or_closer_at_the_end_is_released_by_finish() -> None:
    opening = ReasoningSplitter(ReasoningSpec(open=OPEN, close=CLOSE))
    assert opening.push(b"<a") == (b"", b"") and opening.held == 2
    assert opening.finish() == (b"", b"<a")  # NOTE: never became the opener: answer text
    closing = ReasoningSplitter(ReasoningSpec(open=OPEN, close=CLOSE, inside=True))
    assert closing.push(b"hm</") == (b"hm", b"") and closing.held == 2
    assert closing.finish() == (b"</", b"")  # NOTE: never became the closer: reasoning text
    assert closing.reasoning_bytes == 4
    longest = ReasoningSplitter(ReasoningSpec(open=OPEN, close=CLOSE, inside=True))
    assert longest.push(b"hm</a") == (b"hm", b"") and longest.held == 3  # NOTE: all but 1 byte
    after = ReasoningSplitter(ReasoningSpec(open=OPEN, close=CLOSE, inside=True))
    assert after.push(b"r</a>ans") == (b"r", b"ans")
    assert after.push(b"wer") == (b"", b"wer") and after.finish() == (b"", b"")


def test_k2_no_block_makes_every_later_byte_answer() -> None:
    """The first token was not the opener (a token-level decision): even bytes that spell the
    opener afterwards are answer text."""
    sp = ReasoningSplitter(ReasoningSpec(open=OPEN, close=CLOSE, open_ids=(7,)))
    sp.no_block()
    assert sp.push(b"<a>x</a>") == (b"", b"<a>x</a>")
    assert sp.finish() == (b"", b"") and sp.split() is None


def test_k2_discard_drops_a_held_closer_prefix_without_counting_it() -> None:
    """K2 (cancel, seed §4.3): a held closer prefix was never sent: ``discard`` returns it,
    holds nothing after, and ``reasoning_bytes`` stays what the stream sent (``finish`` would
    have released it as reasoning)."""
    sp = ReasoningSplitter(ReasoningSpec(open=OPEN, close=CLOSE, inside=True))
    assert sp.push(b"x</") == (b"x", b"")
    assert sp.held == 2
    assert sp.discard() == b"</"
    assert sp.held == 0 and sp.reasoning_bytes == 1
    split = sp.split()
    assert split is not None and split.reasoning_bytes == 1
