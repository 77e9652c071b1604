"""The reasoning split against a brute-force oracle (issue 23 item 3; SPEC K2, S1, S2, S3, L6),
through the reference loop on a scripted model whose tokenizer has Qwen3's ``<think>`` and
``</think>`` added tokens (and pieces that spell the markers across several tokens).

The oracle reads the whole decode at once: the reasoning block opens in the prompt (``inside``)
or with the output's first bytes ``<think>``; it ends at the first ``</think>`` after that;
stop strings are searched in the answer only (earliest end, then longest, then configuration
order). The run must send exactly the oracle's reasoning, then exactly its answer (cut at the
stop), record the split on the terminal, and the parts with the removed markers must
reassemble the decode byte for byte (K2).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coda.finish import FinishReason
from coda.output import OutputSpec
from coda.reasoning import ReasoningSpec, ReasoningSplitter
from coda.request import RequestRun
from coda.stream import EventType
from coda.trace import ListTraceSink, check_trace
from tests.conftest import examples
from tests.reference_loop import Choice, generate
from tests.scripted import EOS_ID, ScriptedChooser, ScriptedModel, scripted_tokenizer

OPEN_ID, CLOSE_ID = 150, 151
TABLE = {101: b"a", 102: b"b", 103: b"</", 104: b"think>", 105: b"<", 106: b"/think", 107: b"ab",
         108: b"<th", 109: b"ink>", 110: b">", 111: b"k>\n", 112: b"\n\n"}
ADDED = {OPEN_ID: "<think>", CLOSE_ID: "</think>"}
TOK = scripted_tokenizer(TABLE, added=ADDED)
BYTES = {**TABLE, **{i: s.encode() for i, s in ADDED.items()}}
IDS = sorted(BYTES)
STOPS = ["a", "b", "ab", "ba", "</", "k>", "ink", "\n\n", "<th"]


def _spec(inside: bool, budget: int | None = None) -> ReasoningSpec:
    return ReasoningSpec(inside=inside, close_ids=(CLOSE_ID,), budget_tokens=budget,
                         open_ids=(OPEN_ID,))


def _run(script: list[int], inside: bool, stops: tuple[str, ...], budget: int | None = None,
         stop_ids: tuple[int, ...] = ()):  # type: ignore[no-untyped-def]
    sink = ListTraceSink()
    spec = OutputSpec(max_tokens=1000, eos_token_ids=frozenset({EOS_ID}), stop_strings=stops,
                      stop_token_ids=tuple((i,) for i in stop_ids),
                      reasoning=_spec(inside, budget))
    runs: list[RequestRun] = []
    chooser = ScriptedChooser()

    class Forcing:
        """The engine's role at a budget: the step is masked to the forced closer id."""

        def choose(self, logits: int, step: int, output_ids: list[int]) -> Choice:
            proc = runs[0].processor
            forced = proc.forced_token() if proc is not None else None
            if proc is not None:  # NOTE: what speculation drafts: the closer's ids from here
                assert proc.forced_tokens() == (() if forced is None else (forced,))
            return chooser.choose(forced if forced is not None else logits, step, output_ids)

    run = generate([1], spec, ScriptedModel(script + [EOS_ID, EOS_ID]), Forcing(), TOK, trace=sink,
                   on_created=runs.append)
    assert check_trace(sink.events) == []
    deltas = [e for e in run.stream.events_after(-1) if e.type is EventType.DELTA]
    flags = [e.reasoning for e in deltas]
    assert flags == sorted(flags, reverse=True), "a reasoning delta after an answer delta"
    reasoning = b"".join(e.data for e in deltas if e.reasoning)
    answer = b"".join(e.data for e in deltas if not e.reasoning)
    term = run.stream.terminal
    assert term is not None
    return reasoning, answer, term


def _oracle(script: list[int], inside: bool, stops: tuple[str, ...],
            stop_ids: tuple[int, ...] = ()) -> tuple[bytes, bytes, bytes, bytes, bytes, bool]:
    """(opener, reasoning, closer, answer, full decode, stopped). The block opens in the prompt
    or with the output's first token ``<think>``; it closes at the first ``</think>`` in the
    bytes after that; the answer is the rest, and only the answer's tokens and bytes meet
    stops: the earliest-ending one by token wins, an id stop on a tie (G1 order)."""
    full = b"".join(BYTES[i] for i in script)
    ends = [len(b"".join(BYTES[i] for i in script[:k + 1])) for k in range(len(script))]
    opener = b"<think>" if not inside and script[:1] == [OPEN_ID] else b""
    first_answer_token = 0
    if not inside and not opener:
        closer, reasoning, base = b"", b"", 0
    else:
        at = full.find(b"</think>", len(opener))
        closer = b"</think>" if at >= 0 else b""
        reasoning = full[len(opener):at if at >= 0 else len(full)]
        base = at + len(closer) if at >= 0 else len(full)
        first_answer_token = (next(k for k, e in enumerate(ends) if e >= base) + 1
                              if at >= 0 else len(script))
    rest = full[base:]
    cands = []  # (token, kind order, answer cut)
    for k, s in enumerate(stops):
        for pos in range(len(rest)):
            if rest.startswith(s.encode(), pos):
                last = base + pos + len(s)
                tok = next(j for j, e in enumerate(ends) if e >= last)
                cands.append((tok, 1, last, -len(s), k, pos))
    for j in range(first_answer_token, len(script)):
        if script[j] in stop_ids:
            start = ends[j - 1] if j else 0
            cands.append((j, 0, 0, 0, 0, start - base))
    answer, stopped = rest, False
    if cands:
        answer, stopped = rest[:min(cands)[5]], True
    return opener, reasoning, closer, answer, full, stopped


script_st = st.lists(st.sampled_from(IDS), max_size=14)


@settings(deadline=None, max_examples=examples(400))
@given(script=script_st, inside=st.booleans(),
       stops=st.lists(st.sampled_from(STOPS), max_size=3, unique=True).map(tuple),
       stop_ids=st.lists(st.sampled_from([102, 105, 112, CLOSE_ID]), max_size=2,
                         unique=True).map(tuple))
def test_k2_s1_split_matches_oracle(script: list[int], inside: bool,
                                    stops: tuple[str, ...], stop_ids: tuple[int, ...]) -> None:
    """K2, S1, S2, S3: the reasoning is exactly the oracle's (no stop string cuts it or is
    matched in it, no possible-closer byte leaks into it), the answer exactly the oracle's
    cut at the first stop of the answer, and opener + reasoning + closer + answer reassemble
    the decode."""
    reasoning, answer, term = _run(script, inside, stops, stop_ids=stop_ids)
    opener, want_r, closer, want_a, full, stopped = _oracle(script, inside, stops, stop_ids)
    assert reasoning == want_r
    assert answer == want_a
    assert (term.finish_reason is FinishReason.STOP_SEQUENCE) == stopped
    split = term.reasoning
    if not inside and not opener:
        assert split is None
    else:
        assert split is not None
        assert (split.opener, split.closer, split.reasoning_bytes) == (opener, closer,
                                                                        len(want_r))
    whole = opener + reasoning + closer + answer
    assert full.startswith(whole)
    if stopped:
        assert any(full[len(whole):].startswith(s.encode()) for s in stops) or \
            term.stop is not None and term.stop.kind == "token_ids"
    else:
        assert whole == full
    assert term.usage.returned_bytes == len(reasoning) + len(answer)


@settings(deadline=None, max_examples=examples(200))
@given(script=st.lists(st.sampled_from([101, 102, 103, 105, 107, 112]), max_size=12),
       budget=st.integers(0, 18), tail=st.lists(st.sampled_from([101, 102, 107]), max_size=4))
def test_k2_budget_closes_reasoning_exactly(script: list[int], budget: int,
                                            tail: list[int]) -> None:
    """The reasoning budget (issue 23): after ``budget`` tokens inside the block the closer is
    forced, the answer continues, the terminal says ``forced``. The model's own script is
    taken until then (it never closes by itself here)."""
    full_script = script + tail
    reasoning, answer, term = _run(full_script, True, (), budget=budget)
    split = term.reasoning
    assert split is not None
    if budget <= len(full_script):
        # NOTE: the forced closer takes the place of the model's token at step ``budget``
        assert split.forced and split.closer == b"</think>"
        assert split.reasoning_tokens == budget + 1
        # NOTE: a held "</" prefix before the forced closer is reasoning text
        assert reasoning == b"".join(BYTES[i] for i in full_script[:budget])
        assert answer == b"".join(BYTES[i] for i in full_script[budget + 1:])
    else:
        assert not split.forced and split.closer == b""
        assert reasoning == b"".join(BYTES[i] for i in full_script)
        assert answer == b""


def test_k2_marker_across_tokens_is_held_then_removed() -> None:
    """S2-style holdback of a possible closer: ``</`` waits (not sent as reasoning) until
    ``think>`` makes it the closer, which is removed; then the answer follows."""
    reasoning, answer, term = _run([101, 103, 104, 112, 102], True, ("b",))
    assert (reasoning, answer) == (b"a", b"\n\n")
    assert term.finish_reason is FinishReason.STOP_SEQUENCE
    assert term.reasoning is not None and term.reasoning.closer == b"</think>"


def test_l6_s1_answer_byte_held_by_a_string_before_stop_ids_is_returned() -> None:
    """L6, S1 (a surviving mutant of ``coda.output_ids.end_before_ids``): after a reasoning
    block, the answer ``a`` is held as the start of stop string ``ab`` when the stop id
    ``\\n\\n`` ends the output. ``a`` is the text before the sequence: it is sent, and its
    token counts as returned (offsets of unreturned tokens are in the whole decode's bytes,
    the sequence's start in the answer's: the reasoning bytes lie between)."""
    reasoning, answer, term = _run([101, CLOSE_ID, 101, 112], True, ("ab",), stop_ids=(112,))
    assert (reasoning, answer) == (b"a", b"a")
    assert term.finish_reason is FinishReason.STOP_SEQUENCE
    assert (term.usage.returned_tokens, term.usage.returned_bytes) == (3, 2)


def test_splitter_opening_ruled_out_is_answer() -> None:
    sp = ReasoningSplitter(ReasoningSpec())
    assert sp.push(b"<th") == (b"", b"")
    assert sp.push(b"x") == (b"", b"<thx")
    assert sp.split() is None


def test_p3_stream_log_keeps_the_split() -> None:
    """P3: a replay from the stream log renders the same parts: the delta's reasoning flag and
    the terminal's split survive both codec versions."""
    from coda.durable import codec

    reasoning, answer, term = _run([OPEN_ID, 101, CLOSE_ID, 102], False, ())
    assert (reasoning, answer) == (b"a", b"b")
    sink_run_events = _events([OPEN_ID, 101, CLOSE_ID, 102])
    for ev in sink_run_events:
        for back in (codec.decode_event(codec.encode_event(ev)),
                     codec.unpack_events(ev.request_id, codec.pack_event(ev))[0]):
            assert back.reasoning == ev.reasoning and back.data == ev.data
            if ev.terminal is not None:
                assert back.terminal is not None
                assert back.terminal.reasoning == ev.terminal.reasoning == term.reasoning


def _events(script: list[int]) -> list:  # type: ignore[type-arg]
    spec = OutputSpec(max_tokens=100, eos_token_ids=frozenset({EOS_ID}), reasoning=_spec(False))
    run = generate([1], spec, ScriptedModel(script + [EOS_ID]), ScriptedChooser(), TOK)
    return run.stream.events_after(-1)
