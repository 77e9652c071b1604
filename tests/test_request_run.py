"""How a run ends, through the reference loop on a scripted model: resources and the terminal
on overflow (L7, P6), the order of checks between competing endings (G1), usage with stops
(L6), timings (P5), the drained tail (G2) and the §4.12 failure rows as checker regressions
(O2). Issue 8, "tests that can fail"."""

from __future__ import annotations

from collections.abc import Callable

from coda import trace as tr
from coda.errors import ErrorCode
from coda.finish import FinishReason
from coda.lifecycle import State
from coda.loop import generate
from coda.request import RequestRun
from coda.scripted import EOS_ID, ScriptedChooser, ScriptedModel, scripted_tokenizer
from coda.step import OutputSpec
from coda.stream import BackpressureConfig, BackpressurePolicy, RequestStream
from coda.trace import ListTraceSink, check_trace

TABLE = {101: b"AB", 102: b"CD", 103: b"EF", 104: "é".encode()[:1], 105: "é".encode()[1:],
         107: b"x"}
TOK = scripted_tokenizer(TABLE)


def _spec(**kw: object) -> OutputSpec:
    base: dict[str, object] = dict(max_output_tokens=50, context_limit=1000, prompt_len=2,
                                   eos_token_ids=frozenset({EOS_ID}))
    base.update(kw)
    return OutputSpec(**base)  # type: ignore[arg-type]


def _go(script: list[int], *, stream: RequestStream | None = None,
        on_created: Callable[[RequestRun], None] | None = None,
        hooks: dict[int, Callable[[], None]] | None = None,
        deadline: float | None = None, clock: Callable[[], float] | None = None,
        **kw: object) -> tuple[RequestRun, ListTraceSink, ScriptedModel]:
    sink = ListTraceSink()
    model = ScriptedModel(script, hooks=hooks or {})
    extra = {"clock": clock} if clock is not None else {}
    run = generate([1, 2], _spec(**kw), model, ScriptedChooser(), TOK, trace=sink,
                   stream=stream, on_created=on_created, deadline=deadline, **extra)
    assert check_trace(sink.events) == []
    return run, sink, model


# ---------------------------------------------------------------------------- L7, P6 (defect 5)
def test_l7_p6_reference_loop_overflow_fails_with_its_own_error_and_releases_all() -> None:
    """L7, P6 (defect 5): a bounded buffer that overflows mid-decode ends the run FAILED with
    backpressure_overflow / transport_error, one terminal, every resource released once, the
    text sent so far intact and nothing claimed complete."""
    stream = RequestStream("req-0", BackpressureConfig(BackpressurePolicy.BUFFER, 2, 4))
    run, sink, model = _go([101, 101, 101, 101, EOS_ID], stream=stream)
    t = stream.terminal
    assert t is not None and t.state is State.FAILED
    assert (t.finish_reason, t.error_code) == (FinishReason.TRANSPORT_ERROR,
                                               ErrorCode.BACKPRESSURE_OVERFLOW)
    assert run.lifecycle.state is State.FAILED and run.ledger.held == frozenset()
    assert len(run.ledger.released) == 5 and model.released == 1
    assert stream.text() == "ABAB" and t.usage.returned_bytes == 4
    assert sink.kinds().count(tr.TERMINAL) == 1
