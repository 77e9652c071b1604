"""Issue 20 D4: ``coda trace check`` rejects each corruption of a real trace that the old
checker let through, with a message naming the rule (O1, O2, P2, T1, C1, L2, L6, G1).

The traces are ``tests/data/faultmix_trace.jsonl``, written by ``scripts/trace_faultmix.py``
(the real server and SmolLM2 under a fault mix). Each test corrupts one request the way the
adversarial review did and asserts the named rule fires; on the pre-fix checker every one of
these traces was accepted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from coda import trace as tr
from coda.trace import TraceEvent, check_trace, read_jsonl
from tests.trace_corpus import FAULTMIX_ENDINGS

FAULTMIX = Path(__file__).parent / "data" / "faultmix_trace.jsonl"


def _requests() -> dict[str, list[TraceEvent]]:
    out: dict[str, list[TraceEvent]] = defaultdict(list)
    for ev in read_jsonl(FAULTMIX):
        out[ev.request_id].append(ev)
    return out


def _one(state: str, *, kinds: tuple[str, ...] = ()) -> list[TraceEvent]:
    """The first request of the fixture ending ``state`` whose trace has every kind in ``kinds``."""
    for rows in _requests().values():
        term = next(e for e in rows if e.kind == tr.TERMINAL)
        if term.data["state"] == state and all(any(e.kind == k for e in rows) for k in kinds):
            return rows
    raise AssertionError(f"no {state} request with {kinds} in the fixture")


def _index(rows: list[TraceEvent], kind: str, last: bool = False) -> int:
    idx = [i for i, e in enumerate(rows) if e.kind == kind]
    return idx[-1] if last else idx[0]


def _flags(rows: list[TraceEvent], rule: str) -> list[str]:
    problems = check_trace(rows)
    assert any(p.endswith(f"({rule})") for p in problems), problems
    return problems


def test_fixture_is_a_sound_fault_mix() -> None:
    """The fixture holds what the corpus needs: exactly the ending kinds of FAULTMIX_ENDINGS
    (a regeneration once lost context_limit and the K3 failure), cancels, stop hits, a
    dropped tail, a grammar steer, forward faults and preemptions (T4), and the checker
    accepts it (O1)."""
    events = read_jsonl(FAULTMIX)
    assert check_trace(events) == []
    ends = {(e.data["state"], e.data["reason"]) for e in events if e.kind == tr.TERMINAL}
    assert ends == FAULTMIX_ENDINGS
    kinds = {e.kind for e in events}
    # NOTE: reasoning.split (issue 23) and speculative.verify (issue 21) postdate the fixture;
    # tests/test_reasoning_split.py and tests/test_speculative.py check every trace they write
    assert kinds == tr.KNOWN_KINDS - {tr.REASONING_SPLIT, tr.SPECULATIVE}


def test_issue20_d4_p2_l6_a_dropped_stream_delta_is_rejected() -> None:
    rows = _one("FINISHED", kinds=(tr.STREAM_DELTA,))
    i = _index(rows, tr.STREAM_DELTA)
    _flags(rows[:i] + rows[i + 1:], "P2")


def test_issue20_d4_t1_l6_a_dropped_last_token_selected_is_rejected() -> None:
    rows = _one("FINISHED", kinds=(tr.TOKEN_SELECTED,))
    i = _index(rows, tr.TOKEN_SELECTED, last=True)
    _flags(rows[:i] + rows[i + 1:], "L6")


def test_issue20_d4_c1_a_dropped_cancel_requested_is_rejected() -> None:
    rows = _one("CANCELLED", kinds=(tr.CANCEL_OBSERVED,))
    i = _index(rows, tr.CANCEL_REQUESTED)
    _flags(rows[:i] + rows[i + 1:], "C1")


def _moved_before(rows: list[TraceEvent], kind: str, before: str) -> list[TraceEvent]:
    """``rows`` with the first ``kind`` row moved to just before the first ``before`` row."""
    moved = list(rows)
    moved.insert(_index(rows, before), moved.pop(_index(rows, kind)))
    return moved


def test_issue20_d4_c1_cancel_observed_before_cancel_requested_is_rejected() -> None:
    rows = _one("CANCELLED", kinds=(tr.CANCEL_OBSERVED,))
    _flags(_moved_before(rows, tr.CANCEL_OBSERVED, tr.CANCEL_REQUESTED), "C1")


def test_issue20_d4_g1_a_delta_before_the_first_token_selection_is_rejected() -> None:
    rows = _one("FINISHED", kinds=(tr.STREAM_DELTA,))
    _flags(_moved_before(rows, tr.STREAM_DELTA, tr.TOKEN_SELECTED), "G1")


def test_issue20_d4_l6_a_tampered_usage_selected_tokens_is_rejected() -> None:
    rows = _one("FINISHED", kinds=(tr.TOKEN_SELECTED,))
    i = _index(rows, tr.TERMINAL)
    term = rows[i]
    usage = {**term.data["usage"], "selected_tokens": term.data["usage"]["selected_tokens"] + 1}
    doctored = TraceEvent(term.request_id, term.kind, {**term.data, "usage": usage}, term.ts_ns)
    _flags(rows[:i] + [doctored] + rows[i + 1:], "L6")


def test_issue20_d4_l2_a_terminal_state_changed_finished_to_cancelled_is_rejected() -> None:
    rows = _one("FINISHED")
    i = _index(rows, tr.TERMINAL)
    term = rows[i]
    doctored = TraceEvent(term.request_id, term.kind, {**term.data, "state": "CANCELLED"},
                          term.ts_ns)
    _flags(rows[:i] + [doctored] + rows[i + 1:], "L2")


def test_issue20_d4_every_kind_of_adjacent_swap_is_rejected_unless_a_client_cancel_moves() -> None:
    """Issue 20 D4: each pair of adjacent rows of different content, swapped (timestamps kept in
    place), is rejected; the one exception is a client's cancel.requested moving within the
    window where another thread may write it (the corpus' ``cancel-moves`` entry, C1)."""
    from tests.trace_corpus import ALLOWED, Mutation

    moves = next(a for a in ALLOWED if a.name == "cancel-moves")
    survived: dict[tuple[str, str], int] = defaultdict(int)
    pairs: set[tuple[str, str]] = set()
    for rid, rows in _requests().items():
        for i in range(len(rows) - 1):
            a, b = rows[i], rows[i + 1]
            if (a.kind, a.data) == (b.kind, b.data):
                continue
            m = Mutation("swap", rid, i, ("swap", a.kind, b.kind))
            pairs.add((a.kind, b.kind))
            if moves.match(m, rows):
                continue
            if not check_trace(m.apply(rows)):
                survived[(a.kind, b.kind)] += 1
    assert len(pairs) >= 37 and dict(survived) == {}


def test_c1_g1_a_cancel_recorded_before_a_safe_point_is_observed_there() -> None:
    """C1, G1: a client cancel recorded before a step's decode.completed is visible to the
    cancel check that precedes choose, so a later token.selected means the check was skipped
    (the row count is kept consistent, so only this rule can fire)."""
    rows = _one("FINISHED", kinds=(tr.DECODE_COMPLETED,))
    i = _index(rows, tr.DECODE_COMPLETED)
    cancel = TraceEvent(rows[0].request_id, tr.CANCEL_REQUESTED, {"cause": "client"},
                        rows[i - 1].ts_ns)
    last = rows[-1]
    sealed = TraceEvent(last.request_id, last.kind,
                        {**last.data, "rows": last.data["rows"] + 1}, last.ts_ns)
    problems = _flags(rows[:i] + [cancel] + rows[i:-1] + [sealed], "C1")
    assert all("safe point" in p for p in problems), problems


def test_issue20_d4_cli_exits_nonzero_naming_the_rule(tmp_path: Path) -> None:
    """``coda trace check FILE`` on a corrupted real trace: exit status 1 and the rule named."""
    rows = _one("FINISHED", kinds=(tr.STREAM_DELTA,))
    i = _index(rows, tr.STREAM_DELTA)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in rows[:i] + rows[i + 1:]))
    proc = subprocess.run([sys.executable, "-m", "coda.cli", "trace", "check", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "(P2)" in proc.stdout + proc.stderr


@pytest.mark.parametrize("kind", sorted(tr.KNOWN_KINDS))
def test_o1_each_row_kind_of_the_fixture_is_load_bearing(kind: str) -> None:
    """O1: dropping any one row of any kind the fixture holds is rejected (the trace handle's
    row count alone would catch it; the first message names the specific rule where one
    applies)."""
    for rows in _requests().values():
        idx = [i for i, e in enumerate(rows) if e.kind == kind]
        for i in idx[:3]:
            assert check_trace(rows[:i] + rows[i + 1:]), (kind, i)


@pytest.mark.parametrize(("kind", "key", "value"), [
    (tr.RESOURCE_RELEASED, "resource", {"a": 1}), (tr.LIFECYCLE, "to", {"a": 1}),
    (tr.LIFECYCLE, "from", ["x"]), (tr.PREFILL_STARTED, "cached", [1, "a"]),
    (tr.TERMINAL, "reason", [1, "a"])])
def test_o1_a_row_field_of_another_type_is_a_problem_not_a_crash(
        tmp_path: Path, kind: str, key: str, value: object) -> None:
    """O1: a row whose field has a type the engine never writes (a hand-edited or damaged
    trace) is a problem naming its rule (O1 where the rule could not read the field):
    ``check_trace`` returns it, ``coda trace check`` exits 1 with the verdict. It was the
    rule's own TypeError: a traceback, no verdict."""
    rows = _one("FINISHED", kinds=(kind,))
    i = next(j for j, e in enumerate(rows) if e.kind == kind and key in e.data)
    bad_row = TraceEvent(rows[i].request_id, kind, {**rows[i].data, key: value}, rows[i].ts_ns)
    bad = rows[:i] + [bad_row] + rows[i + 1:]
    problems = check_trace(bad)
    assert problems and all(p.endswith(")") for p in problems), problems  # NOTE: each names a rule
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in bad))
    proc = subprocess.run([sys.executable, "-m", "coda.cli", "trace", "check", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "problem(s)" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("line", ["[1, 2]", '"row"', "3"])
def test_o1_a_line_that_is_no_json_object_is_unreadable_exit_2(tmp_path: Path, line: str) -> None:
    """A line that is JSON but no object is no trace row: one ``error:`` line naming the line,
    exit 2, as other unreadable rows. It was an AttributeError traceback, exit 1."""
    path = tmp_path / "odd.jsonl"
    path.write_text(line + "\n")
    proc = subprocess.run([sys.executable, "-m", "coda.cli", "trace", "check", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: cannot read trace") and "line 1: " in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
