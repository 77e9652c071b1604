"""`coda trace check` names the file line of a row it cannot read (SPEC O1's trace file): a
server killed mid-write leaves a cut last line, and json's own position ("line 1 column 103")
is within that row, so the message pointed at line 1 of a 237-line file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coda.trace import TraceEvent, TraceReadError, read_jsonl

ROOT = Path(__file__).resolve().parent.parent


def _rows(n: int) -> list[str]:
    return [json.dumps(TraceEvent(f"req-{i}", "request.arrived", {}, i).to_dict()) for i in range(n)]


def test_cut_last_row_names_its_file_line(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    rows = _rows(5)
    f.write_text("\n".join(rows[:4]) + "\n\n" + rows[4][:-7], encoding="utf-8")
    with pytest.raises(TraceReadError, match=r"^line 6: JSONDecodeError"):
        read_jsonl(f)
    r = subprocess.run([sys.executable, "-m", "coda.cli", "trace", "check", str(f)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "line 6: JSONDecodeError" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_row_that_is_no_trace_row_names_its_line(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(_rows(2)) + '\n{"a": 1}\n', encoding="utf-8")
    with pytest.raises(TraceReadError, match=r"^line 3: KeyError"):
        read_jsonl(f)
    f.write_text("\n".join(_rows(2)) + "\n", encoding="utf-8")
    assert [e.request_id for e in read_jsonl(f)] == ["req-0", "req-1"]
