"""Streaming conformance fuzz (issue 20 item 4; SPEC S3, K2, K3, P1, P2, P3, P4).

Every (protocol, scenario) case of ``tests/stream_fuzz.py`` (Chat Completions, Completions,
Responses, Anthropic Messages x plain text, multi-byte text, stop strings, forced and ``auto``
tool calls) is sent once whole and once streamed to a real server on loopback over the
embedded default model (seeded sampling; its byte-level tokens carry parts of characters).
Hypothesis then re-chunks the recorded SSE bytes at arbitrary offsets (inside characters,
inside ``data:``), reads them through the conforming parser and the official clients, cuts
them anywhere and resumes through the server, and disconnects fresh streams and resumes them.
Every view must hold: 0 stop-string leaks, 0 split characters, 0 partial tool-call arguments
that are not a prefix of the final ones, streamed == non-streamed.

``CODA_FUZZ_REPORT=PATH`` writes the counts (docs/testing.md) when the module ends.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import stream_fuzz as fz
from tests.conftest import LiveServer, examples
from tests.sdk_views import RechunkTransport, sdk_agrees, sdk_observe
from tests.sse_parse import SSEParser, awkward_offsets, parse_chunks, split_at
from tests.stream_conformance import PROTOCOLS, Tally, observe_stream

TALLY = Tally()


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir(None, EngineConfig(max_num_seqs=8))
    engine.start()
    server = LiveServer(create_app(engine, manage_engine=False)).start()
    server.model = engine.model_name  # type: ignore[attr-defined]
    yield server
    server.stop()
    engine.shutdown()
    if os.environ.get("CODA_FUZZ_REPORT"):
        with open(os.environ["CODA_FUZZ_REPORT"], "w", encoding="utf-8") as f:
            f.write(TALLY.report() + "\n")


@pytest.fixture(scope="module")
def cases(live: Any) -> list[fz.Case]:
    tally = Tally()
    out = [fz.record(live.url, p, s, 0, live.model, tally)
           for p in PROTOCOLS for s in fz.scenarios(p)]
    _merge(tally)
    assert tally.violations == [], tally.report()
    return out


def _merge(tally: Tally) -> None:
    TALLY.checks.update(tally.checks)
    TALLY.counts.update(tally.counts)
    TALLY.violations += tally.violations


def _offsets(data: st.DataObject, raw: bytes) -> list[int]:
    """Read boundaries: every byte alone, or a random set biased to split something."""
    if data.draw(st.integers(0, 9), label="bytewise") == 0:
        return list(range(1, len(raw)))
    awkward = awkward_offsets(raw)
    anywhere = st.integers(1, len(raw) - 1)
    pick = st.one_of(anywhere, st.sampled_from(awkward)) if awkward else anywhere
    return data.draw(st.lists(pick, min_size=1, max_size=24), label="offsets")


def _case(data: st.DataObject, cases: list[fz.Case]) -> fz.Case:
    return data.draw(st.sampled_from(cases), label="case")


def test_p1_s3_k2_recorded_cases_cover_the_scenarios(cases: list[fz.Case]) -> None:
    """The generator is not vacuous: stops hit, calls are made, multi-byte text streams in
    deltas, on every protocol that has them (the invariants ran in ``cases``)."""
    for protocol in PROTOCOLS:
        mine = [c for c in cases if c.protocol == protocol]
        assert any(c.whole.coda and c.whole.coda.get("matched_stop") for c in mine), protocol
        assert any(any(ord(ch) > 0x7F for ch in c.whole.text) for c in mine), protocol
        if protocol != "completions":
            assert any(c.whole.calls for c in mine), protocol
    assert TALLY.checks["stop_leak"] and TALLY.checks["tool_prefix"] and TALLY.checks["utf8"]


@settings(max_examples=examples(60))
@given(data=st.data())
def test_p2_k2_any_network_reads_parse_to_the_same_events(cases: list[fz.Case],
                                                          data: st.DataObject) -> None:
    """P2/K2: the recorded stream read in any reads (split inside characters and fields)
    gives the same events, and every invariant holds on them."""
    case = _case(data, cases)
    tally = Tally()
    fz.rechunk(case, _offsets(data, case.raw), tally)
    _merge(tally)
    assert tally.violations == [], tally.report()


@settings(max_examples=examples(20))
@given(data=st.data())
def test_p1_official_clients_read_any_network_reads_alike(cases: list[fz.Case],
                                                          data: st.DataObject) -> None:
    """The ``openai`` / ``anthropic`` clients, fed the recorded bytes in arbitrary reads, see
    the text, calls, finish reason and usage that the conforming parser sees."""
    case = _case(data, cases)
    chunks = split_at(case.raw, _offsets(data, case.raw))
    tally = Tally()
    sdk = sdk_observe(case.protocol, fz.stream_body(case.protocol, case.body),
                      RechunkTransport([len(c) for c in chunks], case.raw))
    sdk_agrees(f"{case.label}/sdk", sdk, observe_stream(case.protocol, case.events), tally)
    tally.counts["chunkings"] += 1
    _merge(tally)
    assert tally.violations == [], tally.report()


@settings(max_examples=examples(60))
@given(data=st.data())
def test_p3_cut_anywhere_and_resume_through_the_server(live: Any, cases: list[fz.Case],
                                                       data: st.DataObject) -> None:
    """P3: the client holds the stream up to any byte and resumes from its last event id:
    what it held plus the replay is the stream, event for event (cuts inside a group of
    frames that share one id are the new defect of :data:`fz.CUT_INSIDE_GROUPS`)."""
    case = _case(data, cases)
    tally = Tally()
    fz.cut_and_resume(live.url, case, data.draw(st.integers(0, len(case.raw)), label="cut"),
                      tally)
    _merge(tally)
    assert tally.violations == [], tally.report()


@settings(max_examples=examples(8))
@given(data=st.data())
def test_p3_p4_disconnect_mid_stream_and_resume_equals_non_streamed(
        live: Any, cases: list[fz.Case], data: st.DataObject) -> None:
    """P3/P4: a fresh stream (``on_disconnect: "continue"``) read in random reads and closed
    at a random byte, then resumed: the client's whole view is the non-streamed request."""
    case = _case(data, cases)
    sizes = [len(c) for c in split_at(case.raw, _offsets(data, case.raw))]
    tally = Tally()
    fz.live_cut(live.url, case, data.draw(st.integers(1, len(case.raw) - 1), label="cut"),
                sizes, tally)
    _merge(tally)
    assert tally.violations == [], tally.report()


@settings(max_examples=examples(8))
@given(data=st.data())
def test_p1_official_clients_over_rechunked_live_reads(live: Any, cases: list[fz.Case],
                                                       data: st.DataObject) -> None:
    """P1: the official client streaming from the live server, its network reads re-split
    at random, sees the non-streamed request (text, calls, finish reason, usage)."""
    case = _case(data, cases)
    sizes = [len(c) for c in split_at(case.raw, _offsets(data, case.raw))]
    tally = Tally()
    sdk = sdk_observe(case.protocol, fz.stream_body(case.protocol, case.body),
                      RechunkTransport(sizes), live.url)
    tally.counts["requests"] += 1
    sdk_agrees(f"{case.label}/live-sdk", sdk, case.whole, tally)
    _merge(tally)
    assert tally.violations == [], tally.report()


# ---------------------------------------------------------------------------- known defects
def _with(flag: str, value: bool) -> Iterator[None]:
    old = getattr(fz, flag)
    setattr(fz, flag, value)
    try:
        yield
    finally:
        setattr(fz, flag, old)


def test_p3_cut_inside_a_frame_group_resumes_every_frame(live: Any,
                                                         cases: list[fz.Case]) -> None:
    """P3: Anthropic's ``content_block_start`` and its first ``content_block_delta`` come
    from one engine event and share its id; a client that read only the start resumes with
    that id (the last it saw) and must still get the delta."""
    case = next(c for c in cases if c.protocol == "messages" and c.scenario == "tools")
    k = next(i for i in range(1, len(case.events))
             if case.events[i].event == "content_block_delta" and
             case.events[i - 1].event == "content_block_start")
    cut = len(b"".join(_event_bytes(case.raw, k)))
    tally = Tally()
    for _ in _with("CUT_INSIDE_GROUPS", True):
        fz.cut_and_resume(live.url, case, cut, tally)
    assert tally.violations == [], tally.report()


def _event_bytes(raw: bytes, k: int) -> list[bytes]:
    """The raw bytes of the first ``k`` events (each ends with a blank line)."""
    parts = raw.split(b"\n\n")
    return [p + b"\n\n" for p in parts[:k]]


def test_s1_issue20_d2_a_stop_never_cuts_a_forced_call(live: Any) -> None:
    tally = Tally()
    for _ in _with("STOPS_IN_FORCED_CALLS", True):
        for protocol in ("chat", "responses", "messages"):
            fz.record(live.url, protocol, "tools_stop", 0, live.model, tally)
    assert tally.violations == [], tally.report()


def test_s1_k2_a_forced_choice_never_returns_call_text(live: Any) -> None:
    """S1/K2: with ``required`` (Anthropic ``any``) and parallel calls allowed, the output is
    the calls; a budget that ends inside a second call must not hand its raw bytes
    (``<tool_call>\n{"name":``) back as text (seed 1, 70 tokens: one call, then the cut;
    Chat here, all three with ``scripts/stream_fuzz.py --enable PARALLEL_FORCED_CALLS``)."""
    tally = Tally()
    for _ in _with("PARALLEL_FORCED_CALLS", True):
        fz.record(live.url, "chat", "tools_parallel", 1, live.model, tally)
    assert tally.violations == [], tally.report()


def test_issue20_d9_message_start_carries_the_final_usage(live: Any, cases: list[fz.Case]) -> None:
    tally = Tally()
    for _ in _with("CHECK_MESSAGE_START_USAGE", True):
        for case in cases:
            if case.protocol == "messages":
                fz.check_events(case, case.events, tally, case.label)
    assert tally.violations == [], tally.report()


# ---------------------------------------------------------------------------- the parser
@pytest.mark.parametrize("raw, expected", [
    (b"\xef\xbb\xbfdata: a\r\n\r\n", [("", "message", "a")]),
    (b"id: 7\rdata: x\rdata:  y\r\r: c\n\n", [("7", "message", "x\n y")]),
    (b"event: e\ndata\n\nid: 9\n\ndata: z\n\n", [("", "e", ""), ("9", "message", "z")]),
    (b"id: 1\ndata: a\n\nid: 2\ndata: b", [("1", "message", "a")]),
    ("data: é😀\n\n".encode(), [("", "message", "é😀")]),
])
def test_p2_parser_follows_the_event_stream_rules(raw: bytes,
                                                  expected: list[tuple[str, str, str]]) -> None:
    """The parser is an oracle only if it is the standard: BOM, CR / LF / CRLF, comments,
    one leading space, joined data lines, the id that persists, the unfinished event dropped;
    and it says the same for every split of the bytes (here: byte by byte)."""
    for chunks in ([raw], [raw[i:i + 1] for i in range(len(raw))]):
        events, _ = parse_chunks(chunks)
        assert [(e.id, e.event, e.data) for e in events] == expected
    parser = SSEParser()
    parser.feed(b"id: 5\ndata: q\n")
    assert parser.last_id == ""   # NOTE: a reconnect sends the id of a *dispatched* event


def test_s3_k2_p1_each_invariant_can_fail() -> None:
    """The checks are not vacuous: a leaked stop, a split character (a lone surrogate, or a
    stamp whose length is not the delta's bytes), a partial argument that is not a prefix,
    and a streamed text that differs are each one violation of their invariant."""
    from tests.stream_conformance import Observed

    whole = Observed(text_deltas=["héllo"], arg_deltas={"0": ['{"a": 1}']}, names={"0": "f"})
    cases: list[tuple[str, Observed]] = [
        ("stop_leak", Observed(text_deltas=["hé", "llo"], stamps=[None, None])),
        ("utf8", Observed(text_deltas=["h\ud83d", "llo"], stamps=[None, None])),
        ("utf8", Observed(text_deltas=["hé", "llo"],
                          stamps=[{"offset": 0, "length": 2, "digest": ""}, None])),
        ("tool_prefix", Observed(arg_deltas={"0": ['{"b"', ': 1}']}, names={"0": "f"})),
    ]
    for invariant, obs in cases:
        tally = Tally()
        tally.stream("t", obs, ["ll"] if invariant == "stop_leak" else [], whole,
                     engine_offsets=False)
        assert [v.split(":")[0] for v in tally.violations] == [invariant] * (
            2 if invariant == "tool_prefix" else 1), tally.violations
    tally = Tally()
    tally.equal("t", Observed(text_deltas=["hello"], arg_deltas=whole.arg_deltas,
                              names=whole.names), whole)
    assert [v.split(":")[0] for v in tally.violations] == ["equal"]


def test_p3_cut_between_the_usage_chunk_and_done_resumes_with_done_alone(
        live: Any, cases: list[fz.Case]) -> None:
    """P3: the footer (a usage chunk, then [DONE]) is a group of frames: a client cut right
    after the usage chunk resumes from its id and is sent [DONE] alone — not the usage chunk
    again (it had the plain id of the last event, so the footer was re-sent whole)."""
    checked = 0
    for case in cases:
        if case.protocol == "responses" or case.events[-1].data != "[DONE]":
            continue
        cut = case.raw.rindex(b"\n\nid: ") + 2  # NOTE: the start of the [DONE] frame
        tally = Tally()
        fz.cut_and_resume(live.url, case, cut, tally)
        assert tally.violations == [], tally.report()
        checked += tally.counts["cut_points"]
    assert checked >= 3
