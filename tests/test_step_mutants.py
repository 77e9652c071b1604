"""Per-token output processing seen from outside (issue 8, mutation survivors of coda/step.py):
what each delta carries (E1, L6), the stop-buffer clock (P5), the early-stop and grammar hooks
(D2, D6, G1), ``stops_end_at`` (S1, issue 13), ``utf8_tail="drop"`` (K2, K3) and the drain (G2).
Through the reference loop on a scripted model, or an :class:`OutputProcessor` directly where
the loop has no such hook. A fake monotonic clock makes the P5 sums exact.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from coda import trace as tr
from coda.finish import FinishReason
from coda.lifecycle import State
from coda.output import EarlyStopVerdict, OutputProcessor, OutputSpec
from coda.request import RequestRun
from coda.stream import EventType, RequestStream, TokenInfo
from coda.trace import ListTraceSink, NullTraceSink, check_trace
from tests.reference_loop import Choice, generate
from tests.scripted import (
    EOS_ID,
    ManualClock,
    ScriptedChooser,
    ScriptedModel,
    TickingModel,
    output_spec,
    scripted_tokenizer,
)
from tests.tokenizer_fixtures import sentencepiece_bpe

TABLE = {101: b"AB", 102: b"CD", 103: b"EF", 104: "é".encode()[:1], 105: "é".encode()[1:],
         107: b"x", 110: b"<", 111: b"t>", 112: b"<t>", 115: b"<t", 116: b">", 117: b"t>CD"}
TOK = scripted_tokenizer(TABLE)


_spec = output_spec


def _go(script: list[int], model: ScriptedModel | None = None, **kw: object
        ) -> tuple[RequestRun, ListTraceSink]:
    sink = ListTraceSink()
    hooks = kw.pop("hooks", None)
    extra = {k: kw.pop(k) for k in ("grammar_done", "early_stop", "on_created") if k in kw}
    chooser = kw.pop("chooser", ScriptedChooser())
    model = model or ScriptedModel(script, hooks=hooks or {})  # type: ignore[arg-type]
    run = generate([1, 2], _spec(**kw), model, chooser, TOK, trace=sink,  # type: ignore[arg-type]
                   **extra)  # type: ignore[arg-type]
    assert check_trace(sink.events) == []
    return run, sink


def _deltas(run: RequestRun) -> list[tuple[bytes, tuple[int, ...]]]:
    return [(e.data, tuple(t.token_id for t in e.tokens))
            for e in run.stream.events_after(-1) if e.type is EventType.DELTA]


# ------------------------------------------------------------------------------ E1, L6
def test_e1_l6_each_delta_carries_the_tokens_selected_since_the_last_and_eos_trails() -> None:
    """E1, L6: "CD" is held whole as a prefix of "CDX"; the next delta carries both 102 and
    103. EOS is never attached to a delta: it is the terminal's trailing token."""
    run, _ = _go([101, 102, 103, EOS_ID], stop_strings=("CDX",))
    assert _deltas(run) == [(b"AB", (101,)), (b"CDEF", (102, 103))]
    t = run.stream.terminal
    assert t is not None and [i.token_id for i in t.trailing_tokens] == [EOS_ID]


def test_l6_returned_tokens_are_those_whose_first_byte_was_sent() -> None:
    """L6: a token counts as returned once its first visible byte is sent. Stop "DE" ends in
    token 3: "ABC" is sent, tokens 1 and 2 are returned. Stop "CD": "AB" ends exactly at token
    2's first byte, which is not sent: one token returned."""
    run, _ = _go([101, 102, 103, EOS_ID], stop_strings=("DE",))
    t = run.stream.terminal
    assert t is not None and run.stream.text() == "ABC"
    assert (t.usage.selected_tokens, t.usage.returned_tokens, t.usage.returned_bytes) == (3, 2, 3)
    run, _ = _go([101, 102, EOS_ID], stop_strings=("CD",))
    t = run.stream.terminal
    assert t is not None and run.stream.text() == "AB"
    assert (t.usage.selected_tokens, t.usage.returned_tokens, t.usage.returned_bytes) == (2, 1, 2)
    # "B" held for "BX" is sent at the "CD" hit: 2 bytes, still only token 1 returned
    run, _ = _go([101, 102, EOS_ID], stop_strings=("BX", "CD"))
    t = run.stream.terminal
    assert t is not None and run.stream.text() == "AB" and t.usage.returned_tokens == 1
    # "CD" held for "CDX"; "DE" hits in token 3: "C" is sent, tokens 1 and 2 are returned
    run, _ = _go([101, 102, 103, EOS_ID], stop_strings=("CDX", "DE"))
    t = run.stream.terminal
    assert t is not None and run.stream.text() == "ABC" and t.usage.returned_tokens == 2


def test_s1_e1_bytes_held_for_a_string_are_sent_when_only_ids_hold_after_them() -> None:
    """S1, E1: "B" is held for "BX"; then 102 may start the id sequence (102, 103): "B" can no
    longer start a stop string and goes out at token 3, while "CD" waits for the ids; token 3
    (a held id) is not reported with "B" but with its own bytes, once 101 broke the match (K2:
    an entry goes with the delta that sends its last byte)."""
    run, _ = _go([101, 101, 102, 101, EOS_ID], stop_strings=("BX",), stop_token_ids=((102, 103),))
    assert _deltas(run) == [(b"A", (101,)), (b"BA", (101,)), (b"B", ()), (b"CDA", (102, 101)),
                            (b"B", ())]


def test_s1_an_id_sequence_at_the_very_start_sends_nothing() -> None:
    """S1: an id sequence that is the whole output: none of its text is ever sent."""
    run, _ = _go([101, 102, EOS_ID], stop_token_ids=((101, 102),))
    t = run.stream.terminal
    assert t is not None and run.stream.text() == "" and t.finish_reason is FinishReason.STOP_SEQUENCE


# ---------------------------------------------------------------------------------- P5

def _timed(script: list[int], monkeypatch: pytest.MonkeyPatch, **kw: object) -> RequestRun:
    clock = ManualClock(100.0)
    monkeypatch.setattr(time, "monotonic", clock)
    model = TickingModel(script, hooks=kw.pop("hooks", {}))  # type: ignore[arg-type]
    model.clock = clock
    return _go(script, model, **kw)[0]


@pytest.mark.parametrize(("script", "stops", "held_steps", "text"), [
    ([101, 102, 101, 102, EOS_ID], ("BCX",), 2.0, "ABCDABCD"),  # held twice, one step each
    ([101, 102, EOS_ID], ("BC",), 1.0, "A"),                    # held until the stop hit
    ([101, EOS_ID], ("BCX",), 1.0, "AB"),                       # held until the drain
    ([101, 102, 107, 107, 107, EOS_ID], ("BCX",), 1.0, "ABCDxxx"),  # then nothing held
])
def test_p5_stop_buffer_is_the_sum_of_the_held_periods(
        script: list[int], stops: tuple[str, ...], held_steps: float, text: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """P5: stop_buffer_s adds up every period during which some output was held for a stop,
    ended by the release, the stop hit or the drain, and nothing else."""
    run = _timed(script, monkeypatch, stop_strings=stops)
    t = run.stream.terminal
    assert t is not None and run.stream.text() == text
    assert t.stop_buffer_s == held_steps


def test_p5_c2_stop_buffer_ends_when_a_cancel_discards_the_held_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """P5, C2: "B", then "Bx", is held for "Bxy"; a cancel during decode 2 discards it. The
    hold ran from token 1 to the cancel's safe point: two decode steps."""
    box: list[RequestRun] = []
    run = _timed([101, 107, 107, 107], monkeypatch, stop_strings=("Bxy",),
                 on_created=box.append, hooks={2: lambda: box[0].request_cancel()})
    t = run.stream.terminal
    assert t is not None and t.finish_reason is FinishReason.CANCELLED
    assert run.stream.text() == "A" and t.stop_buffer_s == 2.0


# ---------------------------------------------------------------------------- D2, D6
class _ConfidentChooser(ScriptedChooser):
    def choose(self, logits: int, step: int, output_ids: Sequence[int]) -> Choice:
        c = super().choose(logits, step, output_ids)
        return Choice(c.token_id, c.info, c.decision, confidence=0.25)


def test_d2_d6_early_stop_hook_sees_count_and_confidence_and_its_stop_cancels() -> None:
    """D2, D6: the policy is asked after every token with (count, confidence); its stop ends
    the request on the cancel path with the policy's reason and last summary."""
    seen: list[tuple[int, float]] = []

    def policy(n: int, conf: float) -> EarlyStopVerdict:
        seen.append((n, conf))
        return EarlyStopVerdict(FinishReason.CONFIDENCE_STOP if n == 2 else None, {"n": n})

    run, _ = _go([101, 102, 103, EOS_ID], early_stop=policy, chooser=_ConfidentChooser())
    t = run.stream.terminal
    assert seen == [(1, 0.25), (2, 0.25)]
    assert t is not None and t.state is State.CANCELLED
    assert t.finish_reason is FinishReason.CONFIDENCE_STOP and dict(t.early_stop or {}) == {"n": 2}
    assert run.stream.text() == "ABCD"
    # a policy that never stops: the request ends normally, with the last summary
    run, _ = _go([101, EOS_ID], early_stop=lambda n, c: EarlyStopVerdict(None, {"n": n}))
    t = run.stream.terminal
    assert t is not None and t.state is State.FINISHED and t.finish_reason is FinishReason.EOS
    assert dict(t.early_stop or {}) == {"n": 1}


def test_d2_confidence_defaults_to_one_when_the_driver_passes_none() -> None:
    """D2: a driver that has no confidence for a token gives the policy 1.0."""
    seen: list[float] = []

    def policy(n: int, conf: float) -> EarlyStopVerdict:
        seen.append(conf)
        return EarlyStopVerdict(None, {})

    proc = OutputProcessor("r", TOK, _spec(), RequestStream("r"), NullTraceSink(),
                           early_stop=policy)
    assert proc.on_token(101, TokenInfo(101)) is None and seen == [1.0]


# ------------------------------------------------------------------------- G1 grammar
def test_g1_grammar_done_ends_with_its_own_reason() -> None:
    """G1: the grammar check runs after the budget checks; True is grammar_complete, a
    FinishReason is taken as is (grammar_forced_close)."""
    calls: list[int] = []

    def done() -> bool:
        calls.append(1)
        return len(calls) == 2

    run, _ = _go([101, 102, 103, EOS_ID], grammar_done=done)
    t = run.stream.terminal
    assert t is not None and t.finish_reason is FinishReason.GRAMMAR_COMPLETE
    assert run.stream.text() == "ABCD" and t.usage.selected_tokens == 2
    run, _ = _go([101, 102, EOS_ID], grammar_done=lambda: FinishReason.GRAMMAR_FORCED_CLOSE)
    t = run.stream.terminal
    assert t is not None and t.finish_reason is FinishReason.GRAMMAR_FORCED_CLOSE
    assert run.stream.text() == "AB"


@pytest.mark.parametrize("closed", [None, FinishReason.GRAMMAR_FORCED_CLOSE])
@pytest.mark.parametrize(("limits", "reason"), [
    ({"max_tokens": 2}, FinishReason.MAX_OUTPUT_TOKENS),
    ({"max_tokens": 2, "budget_end": FinishReason.CONTEXT_LIMIT}, FinishReason.CONTEXT_LIMIT),
])
def test_g1_budget_end_is_renamed_only_by_a_closed_grammar(
        closed: FinishReason | None, limits: dict[str, object], reason: FinishReason) -> None:
    """G1, issue 13: at max tokens / context limit the budget's check ends the output; a
    grammar that closed within the budget names the reason, otherwise the budget does."""
    proc = OutputProcessor("r", TOK, _spec(**limits), RequestStream("r"), NullTraceSink(),
                           grammar_budget_end=lambda: closed)
    assert proc.on_token(101, TokenInfo(101)) is None
    assert proc.on_token(102, TokenInfo(102)) is (closed or reason)


def test_l4_g1_the_budget_is_counted_once_and_read_by_the_core() -> None:
    """L4, G1, issue 21: ``budget_spent`` is the budget's one per-token check (the core asks it
    before choosing: a budget of 0 is spent at once, prefill only) and ``tokens_left`` the room
    drafts may use; both follow the tokens selected against the plan's ``max_tokens``."""
    proc = OutputProcessor("r", TOK, _spec(max_tokens=3), RequestStream("r"), NullTraceSink())
    assert (proc.budget_spent, proc.tokens_left) == (False, 3)
    assert proc.on_token(101, TokenInfo(101)) is None
    assert (proc.budget_spent, proc.tokens_left) == (False, 2)
    assert proc.on_token(101, TokenInfo(101)) is None
    assert proc.on_token(101, TokenInfo(101)) is FinishReason.MAX_OUTPUT_TOKENS
    assert (proc.budget_spent, proc.tokens_left) == (True, 0)
    none = OutputProcessor("z", TOK, _spec(max_tokens=0), RequestStream("z"), NullTraceSink())
    assert (none.budget_spent, none.tokens_left) == (True, 0)


# ------------------------------------------------------------------------------- O1
def test_o1_trace_records_the_chosen_decision_and_stop_state_per_visible_push() -> None:
    """O1: each token.selected row carries the chooser's decision record; a stop.state row is
    written for each token whose bytes reached the stop matcher (104 alone yields none)."""
    run, sink = _go([101, 104, 105, EOS_ID], stop_strings=("Z",))
    sel = [e.data["decision"] for e in sink.events if e.kind == tr.TOKEN_SELECTED]
    assert sel == [{"rule": "scripted", "step": i} for i in range(4)]
    assert sum(e.kind == tr.STOP_STATE for e in sink.events) == 2
    assert run.stream.text() == "ABé"


# ---------------------------------------------------------------------- S1, issue 13
@pytest.mark.parametrize(("script", "stops", "text", "reason"), [
    ([101, 102, EOS_ID], ("CD",), "AB", FinishReason.STOP_SEQUENCE),     # before the tag
    ([112, 102, EOS_ID], ("CD",), "<t>CD", FinishReason.EOS),           # tag opens the output
    ([101, 112, 102, EOS_ID], ("CD",), "AB<t>CD", FinishReason.EOS),
    ([110, 111, 102, EOS_ID], ("CD",), "<t>CD", FinishReason.EOS),      # tag split "<" "t>"
    ([115, 116, 102, EOS_ID], ("CD",), "<t>CD", FinishReason.EOS),      # tag split "<t" ">"
    ([110, 117, EOS_ID], ("CD",), "<t>CD", FinishReason.EOS),           # "<" then "t>CD"
    # issue 20 D2: a stop inside the tag never cuts it (was "AB<", stop_sequence, on main)
    ([101, 112, EOS_ID], ("t>",), "AB<t>", FinishReason.EOS),
    ([115, 116, 102, EOS_ID], ("<t", ">"), "<t>CD", FinishReason.EOS),
    ([110, 111, EOS_ID], ("<",), "<t>", FinishReason.EOS),
    # ... but a stop in free text that only looked like the tag's start still ends it
    ([101, 110, 107, EOS_ID], ("<",), "AB", FinishReason.STOP_SEQUENCE),
    ([101, 115, 107, EOS_ID], ("<tx",), "AB", FinishReason.STOP_SEQUENCE),
    ([101, 110, EOS_ID], ("<",), "AB", FinishReason.STOP_SEQUENCE),     # decided at the drain
])
def test_s1_stop_strings_apply_only_to_text_before_the_tag(
        script: list[int], stops: tuple[str, ...], text: str, reason: FinishReason) -> None:
    """S1, S2, issue 13 / issue 20 D2: with ``stops_end_at`` set, stop strings are matched
    against the text before the first occurrence of the tag (also split across tokens) —
    never the tag itself or what follows; a possible start of the tag waits until it is
    decided."""
    run, sink = _go(script, stop_strings=stops, stops_end_at=b"<t>")
    t = run.stream.terminal
    assert t is not None and (run.stream.text(), t.finish_reason) == (text, reason)
    off = [e.data for e in sink.events if e.kind == tr.STOP_STATE and "stops_off" in e.data]
    if reason is FinishReason.EOS:
        assert off == [{"held": 0, "detok_pending": 0, "stops_off": True}]


def test_s1_stop_ids_do_not_apply_inside_a_call() -> None:
    """S1, issue 20 D2: past the tag, a stop id sequence no longer ends the output (main: the
    id 102 after the tag ended it, "<t>" stop_sequence); before the tag it still does."""
    run, _ = _go([112, 102, EOS_ID], stop_token_ids=((102,),), stops_end_at=b"<t>")
    t = run.stream.terminal
    assert t is not None and (run.stream.text(), t.finish_reason) == ("<t>CD", FinishReason.EOS)
    run, _ = _go([101, 102, 112, EOS_ID], stop_token_ids=((102,),), stops_end_at=b"<t>")
    t = run.stream.terminal
    assert t is not None
    assert (run.stream.text(), t.finish_reason) == ("AB", FinishReason.STOP_SEQUENCE)


def test_s1_a_two_byte_tag_split_across_tokens_is_found() -> None:
    """S1, issue 13: a two-byte ``stops_end_at`` split "<" + "t>" still turns stops off."""
    run, _ = _go([110, 111, 102, EOS_ID], stop_strings=("CD",), stops_end_at=b"<t")
    assert run.stream.text() == "<t>CD"


# --------------------------------------------------------------------------- K2, K3
def test_k2_k3_utf8_tail_drop_removes_and_records_the_incomplete_tail() -> None:
    """K2, K3: with utf8_tail="drop" an incomplete tail at the drain is removed and recorded
    (terminal and trace), and the request ends FINISHED with the loop's reason."""
    run, sink = _go([101, 104, EOS_ID], utf8_tail="drop")
    t = run.stream.terminal
    assert t is not None and t.state is State.FINISHED and t.finish_reason is FinishReason.EOS
    assert run.stream.text() == "AB" and t.dropped_tail == b"\xc3"
    rows = [e.data for e in sink.events if e.kind == tr.UTF8_TAIL_DROPPED]
    assert rows == [{"nbytes": 1, "hex": "c3"}]


# ---------------------------------------------------------------------------------- G2
def test_g2_held_stop_prefix_is_sent_at_the_drain() -> None:
    """G2: bytes held as a stop prefix when the output ends normally are sent at the drain,
    after what was already sent."""
    run, _ = _go([101, EOS_ID], stop_strings=("BCX",))
    assert _deltas(run) == [(b"A", (101,)), (b"B", ())]
    run, _ = _go([107, 101, EOS_ID], stop_strings=("BCX",))
    assert run.stream.text() == "xAB"


def test_g2_e1_drained_tail_goes_out_with_the_hold_it_releases() -> None:
    """G2, E1: "e" is held for the stop "eX"; finish() drains "中", which ends the hold: the
    released "e" and the drained "中" leave in one delta."""
    tok = sentencepiece_bpe()
    vocab = tok.get_vocab()
    head = [vocab["▁the"]] if "▁the" in vocab else tok.encode("the").ids
    script = head + [vocab[f"<0x{b:02X}>"] for b in "中".encode()]
    spec = OutputSpec(max_tokens=len(script), stop_strings=("eX",))
    run = generate(tok.encode("Hi").ids, spec, ScriptedModel(script), ScriptedChooser(), tok)
    deltas = [e.data for e in run.stream.events_after(-1) if e.type is EventType.DELTA]
    assert run.stream.text().endswith("the中") and deltas[-1] == "e中".encode()
