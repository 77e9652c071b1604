"""`coda trace check` names the file line of a row it cannot read (SPEC O1's trace file): a
server killed mid-write leaves a cut last line, and json's own position ("line 1 column 103")
is within that row, so the message pointed at line 1 of a 237-line file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coda.trace import TraceEvent, TraceReadError, check_trace, read_jsonl

ROOT = Path(__file__).resolve().parent.parent
FAULTMIX = ROOT / "tests" / "data" / "faultmix_trace.jsonl"


def _rows(n: int) -> list[str]:
    return [json.dumps(TraceEvent(f"req-{i}", "request.arrived", {}, i).to_dict()) for i in range(n)]


def test_cut_last_row_names_its_file_line(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    rows = _rows(5)
    f.write_text("\n".join(rows[:4]) + "\n\n" + rows[4][:-7], encoding="utf-8")
    with pytest.raises(TraceReadError, match=r"^line 6: JSONDecodeError"):
        read_jsonl(f)
    r = _check(f)
    # NOTE: the four whole rows are checked (no row of a request's lifecycle: they pass)
    assert r.returncode == 0 and "line 6: JSONDecodeError" in r.stderr, r.stderr[-2000:]
    assert "the last line is cut" in r.stderr and "Traceback" not in r.stderr


def _check(f: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coda.cli", "trace", "check", str(f)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_o1_cut_last_line_is_said_and_the_whole_rows_are_checked(tmp_path: Path) -> None:
    """A server SIGKILLed mid-row leaves a cut last line: it was "cannot read trace", exit 2,
    and nothing checked. Now one warning line on stderr names it, the partial row is left out
    and the whole rows are judged: a real trace with a new request's first row cut passes."""
    f = tmp_path / "t.jsonl"
    whole = FAULTMIX.read_text(encoding="utf-8")
    f.write_text(whole + '{"request_id": "cut-1", "kind": "life', encoding="utf-8")
    r = _check(f)
    n = whole.count("\n")
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert f"{n} events, every invariant holds" in r.stdout, r.stdout
    warning, = r.stderr.strip().splitlines()
    assert "the last line is cut" in warning and f"line {n + 1}: JSONDecodeError" in warning
    with pytest.raises(TraceReadError, match=rf"^line {n + 1}: "):
        read_jsonl(f)  # NOTE: the strict reader of whole traces still refuses it


def test_o1_cut_mid_request_reports_that_request_only(tmp_path: Path) -> None:
    """Cut inside a request's rows (its last release lost): that request, and only it, is
    reported by its rule (the checker accepts only what a run could have written to its end);
    the cut is said, not called unreadable."""
    f = tmp_path / "t.jsonl"
    whole = FAULTMIX.read_text(encoding="utf-8")
    f.write_text(whole[:-40], encoding="utf-8")
    last_id = json.loads(whole.splitlines()[-1])["request_id"]
    r = _check(f)
    assert r.returncode == 1 and "the last line is cut" in r.stderr, r.stderr[-2000:]
    problems = [ln for ln in r.stdout.splitlines() if ln.endswith(")")]
    assert problems and all(ln.startswith(f"{last_id}: ") for ln in problems), r.stdout


def test_row_that_is_no_trace_row_names_its_line(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(_rows(2)) + '\n{"a": 1}\n', encoding="utf-8")
    with pytest.raises(TraceReadError, match=r"^line 3: KeyError"):
        read_jsonl(f)
    f.write_text("\n".join(_rows(2)) + "\n", encoding="utf-8")
    assert [e.request_id for e in read_jsonl(f)] == ["req-0", "req-1"]


def test_o1_a_row_without_ts_ns_reads_as_time_zero(tmp_path: Path) -> None:
    """SPEC O1's trace file: a row with no ``ts_ns`` (a hand-written trace, a writer that
    leaves the time out) reads as time 0, "not recorded": the O1 order rule's floor, so it
    orders before every timed row of its request and never after one; not the reader's
    "now" (the event's own default), which would make two reads of one file differ. A
    timestamp-free trace is judged on its rows' order alone."""
    bare = TraceEvent.from_dict({"request_id": "r", "kind": "lifecycle", "to": "QUEUED"})
    assert (bare.ts_ns, dict(bare.data)) == (0, {"to": "QUEUED"})
    rows = [json.loads(line) for line in FAULTMIX.read_text(encoding="utf-8").splitlines()]
    for row in rows:
        del row["ts_ns"]
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    events = read_jsonl(f)
    assert {e.ts_ns for e in events} == {0} and events == read_jsonl(f)
    assert check_trace(events) == []
    # NOTE: an untimed first row, then one timed at 0: in order (0 is not before "not recorded")
    rows[1]["ts_ns"] = 0
    f.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    assert check_trace(read_jsonl(f)) == []


def _served(rows: list[dict[str, object]], **extra: object) -> str:
    return json.dumps({"request_id": "r", "dropped_rows": 0, "rows": rows, **extra})


def test_o1_a_served_trace_reads_as_its_rows(tmp_path: Path) -> None:
    """O1: a saved ``GET /v1/traces/{id}`` answer (one line or indented, leading blanks too)
    reads as that request's rows: the kind, the row's fields but ``kind`` / ``t_ms``, and
    ``ts_ns`` from ``t_ms`` (which keeps their order)."""
    from coda.trace import served_rows

    rows: list[dict[str, object]] = [{"kind": "request.arrived", "t_ms": 0.0},
                                     {"kind": "token.selected", "t_ms": 1.5, "t": 0, "token": 7}]
    want = [TraceEvent("r", "request.arrived", {}, 0),
            TraceEvent("r", "token.selected", {"t": 0, "token": 7}, 1_500_000)]
    assert served_rows(_served(rows)) == want
    assert served_rows("\n  " + json.dumps(json.loads(_served(rows)), indent=2)) == want
    f = tmp_path / "saved.json"
    f.write_text(_served(rows), encoding="utf-8")
    assert read_jsonl(f) == want


@pytest.mark.parametrize("text", [
    "", "[]", '"{"', "{", json.dumps({"request_id": "r", "kind": "x", "rows": []}),
    json.dumps({"request_id": 3, "rows": []}), json.dumps({"request_id": "r", "rows": {}}),
    json.dumps({"rows": []}), '{"request_id": "r", "rows": []}\n{"request_id": "r", "rows": []}',
])
def test_o1_what_is_no_served_trace_is_none(text: str) -> None:
    """Anything but one served answer (a row, JSONL, a cut file, another document) is not
    taken for one: None, and the line reader decides."""
    from coda.trace import served_rows

    assert served_rows(text) is None


def test_o1_a_served_trace_with_a_bad_row_is_unreadable() -> None:
    from coda.trace import served_rows

    for row in ({"kind": "x"}, {"t_ms": 1.0}, {"kind": "x", "t_ms": "soon"}):
        with pytest.raises(TraceReadError, match="no trace row"):
            served_rows(_served([row]))


def test_o1_only_the_last_line_can_be_cut(tmp_path: Path) -> None:
    """A row that is no JSON before the last line is unreadable (it ends in a newline: no
    writer was killed writing it), even when cut rows are tolerated."""
    f = tmp_path / "t.jsonl"
    rows = _rows(3)
    f.write_text(rows[0] + "\n" + rows[1][:-7] + "\n" + rows[2] + "\n", encoding="utf-8")
    cut: list[TraceReadError] = []
    with pytest.raises(TraceReadError, match=r"^line 2: JSONDecodeError"):
        read_jsonl(f, cut)
    assert cut == []
