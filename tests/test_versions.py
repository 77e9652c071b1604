"""The finish-reason enum version and the stop tie-rule version are emitted with every ending
and verified by the trace checker (issue 8; SPEC L4, S4, O1, O2).

Emitted in: the terminal event (``Terminal.finish_reason_version`` / ``stop_rule_version``),
the API's ``coda.versions``, the trace's terminal row and every stop.hit row.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from typer.testing import CliRunner

from coda import trace as tr
from coda.cli import app
from coda.finish import FINISH_REASON_VERSION, REASONS_BY_VERSION, FinishReason
from coda.output import OutputSpec
from coda.server.mapping import coda_extension
from coda.stops import STOP_RULE_VERSION
from coda.trace import ListTraceSink, TraceEvent, check_trace
from tests.reference_loop import generate
from tests.scripted import EOS_ID, ScriptedChooser, ScriptedModel, scripted_tokenizer

TOK = scripted_tokenizer({101: b"AB", 102: b"CD"})


def stop_run() -> tuple[ListTraceSink, object]:
    sink = ListTraceSink()
    spec = OutputSpec(max_tokens=10, eos_token_ids=frozenset({EOS_ID}), stop_strings=("BC",))
    run = generate([1, 2], spec, ScriptedModel([101, 102, EOS_ID]), ScriptedChooser(), TOK,
                   trace=sink)
    return sink, run


def test_l4_s4_versions_in_terminal_coda_object_and_trace_rows() -> None:
    sink, run = stop_run()
    term = run.stream.terminal  # type: ignore[attr-defined]
    assert term.finish_reason is FinishReason.STOP_SEQUENCE
    assert (term.finish_reason_version, term.stop_rule_version) == (FINISH_REASON_VERSION, STOP_RULE_VERSION)
    assert coda_extension(term)["versions"] == {"finish_reason": FINISH_REASON_VERSION,
                                                "stop_rule": STOP_RULE_VERSION}
    row = next(e for e in sink.events if e.kind == tr.TERMINAL)
    assert row.data["finish_reason_version"] == FINISH_REASON_VERSION
    assert row.data["stop_rule_version"] == STOP_RULE_VERSION
    hit = next(e for e in sink.events if e.kind == tr.STOP_HIT)
    assert hit.data["stop_rule_version"] == STOP_RULE_VERSION
    assert check_trace(sink.events) == []


def _with(events: list[TraceEvent], kind: str, **change: object) -> list[TraceEvent]:
    out = []
    for e in events:
        if e.kind == kind:
            data = {k: v for k, v in e.data.items() if k not in change or change[k] is not None}
            data.update({k: v for k, v in change.items() if v is not None})
            e = replace(e, data=data)
        out.append(e)
    return out


def test_o2_l4_s4_checker_rejects_missing_unknown_or_mismatched_versions() -> None:
    """Each broken version field is a checker finding (O2 style: fails on the symptom)."""
    sink, _ = stop_run()
    good = list(sink.events)
    cases = {
        "missing finish_reason_version": _with(good, tr.TERMINAL, finish_reason_version=None),
        "unknown finish_reason_version": _with(good, tr.TERMINAL, finish_reason_version=99),
        "reason not in version 1": _with(good, tr.TERMINAL, finish_reason_version=1,
                                         reason="confidence_stop"),
        "missing terminal stop_rule_version": _with(good, tr.TERMINAL, stop_rule_version=None),
        "unknown stop rule on stop.hit": _with(good, tr.STOP_HIT, stop_rule_version="0"),
    }
    for name, events in cases.items():
        assert check_trace(events) != [], name
    # version 1 still checks its own members: stop_sequence is in both
    assert "stop_sequence" in REASONS_BY_VERSION[1] and "confidence_stop" not in REASONS_BY_VERSION[1]
    assert check_trace(_with(good, tr.TERMINAL, finish_reason_version=1)) == []


def test_o1_cli_trace_check_verifies_versions(tmp_path: Path) -> None:
    sink, _ = stop_run()
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in sink.events))
    broken = _with(list(sink.events), tr.TERMINAL, finish_reason_version=None)
    bad.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in broken))
    assert CliRunner().invoke(app, ["trace", "check", str(good)]).exit_code == 0
    res = CliRunner().invoke(app, ["trace", "check", str(bad)])
    assert res.exit_code == 1 and "finish_reason_version" in res.output
