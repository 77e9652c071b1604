"""Stop id sequences and stop strings on a byte-fallback tokenizer, against a brute-force
oracle (issue 20: the id-sequence regression; SPEC S1-S4, K1-K3, G2), through the reference loop
on a scripted model and a real SentencePiece-style tokenizer (``<0xNN>`` byte tokens).

A byte-fallback run is decoded as one group, so its bytes wait in the detokenizer until a text
token closes it. An id sequence that ends the output must still return every byte of the
tokens before its first id -- also bytes still waiting in such a run, and also when a partial
match of another sequence was pending. The oracle re-decodes the whole output after every token:

* visible(ids): decode(ids) without a trailing byte run that is still valid UTF-8 (or the
  valid start of a character): what may be sent so far (K1);
* an id sequence that is a suffix of ids[:t] ends the output (longest, then configuration
  order) with text before(ids[:t - len]): the decode of those ids less a trailing partial
  character, which is removed and recorded (K2) -- unless a stop string occurs in that text
  (bytes a byte run held until the sequence closed it may complete one): it ends first and
  wins (S4, earliest end; no stop string reaches the stream);
* otherwise the earliest-ending stop string in visible(ids[:t]) ends it (then longest, then
  configuration order), text before it; at the same token an id sequence wins (G1 order).
"""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from coda.finish import FinishReason
from coda.output import OutputSpec
from coda.trace import ListTraceSink, check_trace
from tests.reference_loop import generate
from tests.scripted import ScriptedChooser, ScriptedModel
from tests.tokenizer_fixtures import sentencepiece_bpe

TOK = sentencepiece_bpe()
VOCAB = TOK.get_vocab()
EOS = VOCAB["</s>"]
# NOTE: two plain word pieces of the trained vocabulary (which ones depends on the corpus)
TEXT = [VOCAB[k] for k in sorted(k for k in VOCAB if re.fullmatch("▁[a-z]{2,3}", k))[:2]]
BYTES = {VOCAB[f"<0x{b:02X}>"]: b for b in (0x68, 0x69, 0x41, 0xE2, 0x82, 0xAC)}  # h i A €
IDS = sorted([*TEXT, *BYTES])
PROMPT = [TEXT[1]]


def _decode(ids: list[int]) -> bytes:
    base = TOK.decode(PROMPT)
    full = TOK.decode(PROMPT + ids)
    assert full.startswith(base)
    return full[len(base):].encode()


def _run_len(ids: list[int]) -> int:
    n = 0
    while n < len(ids) and ids[len(ids) - 1 - n] in BYTES:
        n += 1
    return n


def _run_state(ids: list[int]) -> tuple[int, int]:
    """(trailing byte tokens, bytes of a trailing partial character; -1 if the run is invalid)."""
    n = _run_len(ids)
    raw = bytes(BYTES[i] for i in ids[len(ids) - n:])
    try:
        raw.decode("utf-8")
        return n, 0
    except UnicodeDecodeError as err:
        if err.reason != "unexpected end of data":
            return n, -1
        return n, len(raw) - err.start


def _visible(ids: list[int]) -> bytes:
    n, partial = _run_state(ids)
    return _decode(ids) if partial < 0 else _decode(ids[: len(ids) - n])


def _before(ids: list[int]) -> bytes:
    _, partial = _run_state(ids)
    return _decode(ids[: len(ids) - partial]) if partial > 0 else _decode(ids)


Result = tuple[bytes, FinishReason, object]


def _oracle(script: list[int], strings: tuple[str, ...],
            seqs: tuple[tuple[int, ...], ...]) -> Result:
    for t in range(1, len(script) + 1):
        ids = script[:t]
        id_hits = [(-len(q), i) for i, q in enumerate(seqs)
                   if len(q) <= t and tuple(ids[t - len(q):]) == q]
        vis = _visible(ids)
        if id_hits:
            neg, i = min(id_hits)
            vis = _before(ids[: t + neg])  # NOTE: the drained bytes are output: matched too
        found = [(vis.find(s.encode()) + len(s.encode()), -len(s.encode()), i)
                 for i, s in enumerate(strings) if s.encode() in vis]
        if found:  # NOTE: before the ids, a string found now ends first (S4)
            end, neg_s, j = min(found)
            return vis[: end + neg_s], FinishReason.STOP_SEQUENCE, ("string", j)
        if id_hits:
            return vis, FinishReason.STOP_SEQUENCE, ("token_ids", i)
    return _decode(script), FinishReason.EOS, None


def _run(script: list[int], strings: tuple[str, ...],
         seqs: tuple[tuple[int, ...], ...]) -> Result:
    sink = ListTraceSink()
    spec = OutputSpec(max_tokens=1000, eos_token_ids=frozenset({EOS}), stop_strings=strings, stop_token_ids=seqs)
    run = generate(PROMPT, spec, ScriptedModel([*script, EOS]), ScriptedChooser(), TOK,
                   trace=sink)
    assert check_trace(sink.events) == []
    term = run.stream.terminal
    assert term is not None
    stop = (term.stop.kind, term.stop.index) if term.stop is not None else None
    return run.stream.text().encode(), term.finish_reason, stop


H, I_, A = (VOCAB[f"<0x{b:02X}>"] for b in (0x68, 0x69, 0x41))


def test_s1_stop_ids_return_the_byte_run_before_the_sequence() -> None:
    """Issue 20 (S1, S3): output ``h i a b`` in byte tokens with sequences ``[[a, z], [b]]``:
    ``a`` is a pending partial match when ``[b]`` completes. The answer is everything before
    ``b`` (``hiA``), not the empty text (the byte run waited in the detokenizer and was
    discarded with the sequence's bytes)."""
    z, b = TEXT[0], VOCAB["<0xE2>"]
    got = _run([H, I_, A, b], (), ((A, z), (b,)))
    assert got == (b"hiA", FinishReason.STOP_SEQUENCE, ("token_ids", 1))
    assert _run([H, I_, A, z], ("x",), ((A, z),)) == (b"hi", FinishReason.STOP_SEQUENCE,
                                                   ("token_ids", 0))


def test_k2_s1_partial_character_before_stop_ids_is_cut() -> None:
    """K2, K3, S1: ``h`` + the first two bytes of ``€`` then stop id ``[A]``: the text is ``h``;
    the partial character is removed and recorded, never a failure (the stop cut it)."""
    e2, x82 = VOCAB["<0xE2>"], VOCAB["<0x82>"]
    assert _run([H, e2, x82, A], (), ((A,),)) == (b"h", FinishReason.STOP_SEQUENCE,
                                                ("token_ids", 0))
    spec = OutputSpec(max_tokens=1000, eos_token_ids=frozenset({EOS}), stop_token_ids=((A,),))
    run = generate(PROMPT, spec, ScriptedModel([H, e2, x82, A, EOS]), ScriptedChooser(), TOK)
    assert run.stream.terminal is not None and run.stream.terminal.dropped_tail == b"\xe2\x82"


_strings = st.lists(st.text(alphabet="hiA €" + TOK.decode(TEXT), min_size=1, max_size=3),
                   max_size=2)
_seqs = st.lists(st.lists(st.sampled_from(IDS), min_size=1, max_size=3).map(tuple), max_size=3)


@given(st.lists(st.sampled_from(IDS), max_size=10), _strings, _seqs)
def test_s1_s4_k1_byte_fallback_stops_equal_brute_force(
        body: list[int], strings: list[str], seqs: list[tuple[int, ...]]) -> None:
    """Issue 20 (S1-S4, K1-K3): for all outputs over text and byte tokens (ending on a text
    token, so a normal end has no partial character), stop strings and id sequences, the text,
    reason and matched stop equal the re-decoding oracle."""
    script = [*body, TEXT[0]]
    assert _run(script, tuple(strings), tuple(seqs)) == _oracle(script, tuple(strings),
                                                                tuple(seqs))


def test_s1_l6_k2_bytes_drained_before_a_stop_id_are_output_of_a_returned_token() -> None:
    """S1, L6, K2 (found by the property above): a byte-fallback token whose byte is still in
    the detokenizer when the next id completes a stop id sequence is drained and sent; its
    bytes are detokenizer output in the trace and the token counts as returned."""
    word = TOK.encode("and", add_special_tokens=False).ids
    byte, stop = TOK.token_to_id("<0x42>"), TOK.encode(" the", add_special_tokens=False).ids[-1]
    assert byte is not None and len(word) >= 1
    sink = ListTraceSink()
    spec = OutputSpec(max_tokens=1000, eos_token_ids=frozenset({EOS}), stop_token_ids=((stop,),))
    run = generate(PROMPT, spec, ScriptedModel([*word, byte, stop, EOS]), ScriptedChooser(), TOK,
                   trace=sink)
    assert check_trace(sink.events) == []
    term = run.stream.terminal
    assert term is not None and term.finish_reason is FinishReason.STOP_SEQUENCE
    deltas = [e.data for e in sink.events if e.kind == "stream.delta"]
    assert deltas[-1]["text"] == "B"  # NOTE: the drained byte token's text, sent
    assert term.usage.returned_bytes == sum(d["nbytes"] for d in deltas)
    assert term.usage.returned_tokens == len(word) + 1


def test_s1_l6_byte_run_closed_by_a_held_id_of_a_longer_sequence_is_returned() -> None:
    """S1, L6, K2 (found by the property above at CI's example count): ``A`` as a byte token,
    then a word token twice with the id sequence ``[word, word]``. The first ``word`` closes
    the byte run (the detokenizer outputs ``A`` with the word's bytes) and is held as a
    partial match; the second completes the sequence. The answer is ``A``, drained from the
    detokenizer as it was before the sequence, and the byte token counts as returned (it was
    counted against the discarded bytes' offsets: returned_tokens 0 for 1 byte sent)."""
    word = TEXT[0]
    sink = ListTraceSink()
    spec = OutputSpec(max_tokens=1000, eos_token_ids=frozenset({EOS}), stop_token_ids=((word, word),))
    run = generate(PROMPT, spec, ScriptedModel([A, word, word, EOS]), ScriptedChooser(), TOK,
                   trace=sink)
    assert check_trace(sink.events) == []
    term = run.stream.terminal
    assert term is not None and term.finish_reason is FinishReason.STOP_SEQUENCE
    assert run.stream.text() == "A"
    assert (term.usage.returned_tokens, term.usage.returned_bytes) == (1, 1)


def test_s4_s1_a_stop_string_completed_by_bytes_drained_before_stop_ids_wins() -> None:
    """S4, S1, S3 (found by the property above at CI's example count): a word ending in
    ``c``, the byte token ``A``, then a stop id; stop string ``cA``. The byte waits in the
    detokenizer until the stop id ends the output; drained, it completes ``cA``, which ends
    before the ids and wins: the text stops before it and ``cA`` never reaches the stream
    (it leaked before, and the trace checker flagged the drain's row order)."""
    word, stop_id = TEXT
    last = TOK.decode([word])[-1]
    sink = ListTraceSink()
    spec = OutputSpec(max_tokens=1000, eos_token_ids=frozenset({EOS}), stop_strings=(last + "A",),
                      stop_token_ids=((stop_id,),))
    run = generate(PROMPT, spec, ScriptedModel([word, A, stop_id, word, EOS]),
                   ScriptedChooser(), TOK, trace=sink)
    assert check_trace(sink.events) == []
    term = run.stream.terminal
    assert term is not None and term.stop is not None
    assert (term.finish_reason, term.stop.kind) == (FinishReason.STOP_SEQUENCE, "string")
    assert run.stream.text() == _decode([word])[:-1].decode()
    assert (last + "A") not in run.stream.text()
