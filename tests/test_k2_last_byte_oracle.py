"""Which delta carries each token's entry, against a brute-force oracle (SPEC K2, K3, S2, S3;
coda.output with coda.token_ends): the delta that sends the token's LAST byte, counted in the
text the client holds, whatever the text's length is next to the pieces' (an invalid byte's
U+FFFD is three bytes for one, a character split across tokens is held by the detokenizer).

The oracle knows nothing of the processor: the text is the lossy UTF-8 decode of all the
pieces; a token's last byte is sent once the client holds the shortest clean prefix of the
text (one that decoding a prefix of the pieces gives) reaching past the token's bytes. Tokens
past the text's end are the terminal's trailing ones; the one a stop string cuts keeps the
bytes of its part before the stop and is reported once, from the cut delta or the terminal
(``trailing_shown``); a partial character a budget cuts off is dropped (K3), its tokens
trailing, their entries without its bytes.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coda.finish import FinishReason
from coda.server.logprobs import reported_trailing
from tests.conftest import examples
from tests.test_k2_entry_timing import _run

# NOTE: whole characters, invalid bytes, and characters whose bytes the split cuts apart
_UNITS = [b"a", b"b", b"\n", "é".encode(), "€".encode(), "😀".encode(), b"\xff", b"\xc0",
          b"\x80", b"\xe2\x82", b"\xf0\x9f"]
_STOPS = ["a", "b", "ab", "ba", "é", "\ufffd", "a\ufffd", "€a", "\n\n", "xx"]


@st.composite
def _cases(draw: st.DrawFn) -> tuple[list[bytes], tuple[str, ...], bool]:
    whole = b"".join(draw(st.lists(st.sampled_from(_UNITS), min_size=1, max_size=8)))
    cuts = sorted(draw(st.sets(st.integers(1, len(whole) - 1), max_size=7))
                  if len(whole) > 1 else set())
    bounds = [0, *cuts, len(whole)]
    pieces = [whole[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    stops = tuple(draw(st.lists(st.sampled_from(_STOPS), max_size=2, unique=True)))
    return pieces, stops, draw(st.booleans())


def _clean(whole: bytes, text: bytes, c: int) -> int | None:
    """Text bytes of the decode of ``whole[:c]`` where it is a prefix of ``text``, else None."""
    head = whole[:c].decode("utf-8", "replace").encode()
    return len(head) if text.startswith(head) else None


def _oracle_end(whole: bytes, text: bytes, end: int) -> int:
    """Text offset after the character holding byte ``end - 1`` (0 for ``end`` 0)."""
    return next(n for c in range(end, len(whole) + 1)
                if (n := _clean(whole, text, c)) is not None)


def _kept(whole: bytes, text: bytes, start: int, end: int, sent: int) -> int:
    """Bytes of the piece ``whole[start:end]`` whose characters all lie within ``sent``."""
    best = start
    for c in range(start, end + 1):
        n = _clean(whole, text, c)
        if n is not None and n <= sent:
            best = c
    return best - start


def _partial_tail(whole: bytes) -> bytes:
    """The bytes a budget end cuts off (K3): ``whole``'s last bytes that start a character
    they do not finish (b"" when it ends on a whole character or an invalid byte)."""
    for n in (3, 2, 1):
        try:
            whole[-n:].decode("utf-8")
        except UnicodeDecodeError as exc:
            if len(whole) >= n and exc.start == 0 and exc.reason == "unexpected end of data":
                return whole[-n:]
    return b""


def _without_tail(pieces: list[bytes], n: int) -> list[bytes]:
    """``pieces`` less their last ``n`` bytes, every piece kept (K2: the entries of the tokens
    a budget's cut removed text from show none of it)."""
    out = list(pieces)
    for i in reversed(range(len(out))):
        k = min(n, len(out[i]))
        out[i], n = out[i][:len(out[i]) - k], n - k
    return out


@settings(max_examples=examples(400), deadline=None)
@given(_cases())
def test_k2_every_entry_rides_with_the_delta_that_sends_its_last_byte(
        case: tuple[list[bytes], tuple[str, ...], bool]) -> None:
    """K2, S2, S3: for random byte pieces (valid and invalid UTF-8, characters split across
    tokens) and stop strings, each token's entry is carried whole by exactly the first delta
    after which the client holds its last byte; a stop's cut token once, cut to the text."""
    pieces, stops, include = case
    deltas, terminal, selected = _run(list(pieces), stops, True, include)
    text_sent = b"".join(data for data, _ in deltas)
    carried = [t.token_id for _, ts in deltas for t in ts]
    # NOTE: every selected token, in order, in a delta or the terminal (the text and the
    # pieces differ here, so the entries need not reassemble it: test_k2_entry_timing)
    assert carried + [t.token_id for t in terminal.trailing_tokens] == selected
    whole = b"".join(pieces)
    text = whole.decode("utf-8", "replace").encode()
    cum, n = [], 0
    for data, _ in deltas:
        n += len(data)
        cum.append(n)
    sent = len(text_sent)
    expected: list[list[bytes]] = [[] for _ in deltas]
    cut: bytes | None = None  # NOTE: the cut token's kept part (ids in order: _check)
    start, stopped = 0, terminal.finish_reason is FinishReason.STOP_SEQUENCE
    rest: list[bytes] = []  # NOTE: a budget's end reports every trailing token, less the cut
    for piece in pieces:
        end = start + len(piece)
        last = _oracle_end(whole, text, end)
        if last <= sent and not rest and cut is None:
            expected[next(i for i, c in enumerate(cum) if c >= last)].append(piece)
        elif stopped:
            m = _kept(whole, text, start, end, sent)
            cut = piece[:m] if m else None
            break
        else:
            rest.append(piece)
        start = end
    got = [[t.piece for t in ts] for _, ts in deltas]
    trailing = [t.piece for t in reported_trailing(terminal)]
    if not stopped:
        assert trailing == _without_tail(rest, len(_partial_tail(whole)))
    elif cut is not None and trailing != [cut]:  # NOTE: or in the cut delta, not both
        assert got[-1][-1:] == [cut] and not trailing
        got[-1] = got[-1][:-1]
    elif cut is None:
        assert trailing == []
    assert got == expected
