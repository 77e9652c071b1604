"""The playground at ``/``, its trace and cancel endpoints, and the page in a real browser
(issue 13 items 3–4; SPEC O1, C1, L1, P5).

The browser is Debian's ``chromium`` driven by Playwright for Python (``executable_path``):
Playwright talks to the browser over CDP with no separate driver binary to keep in lock-step
with the browser (Selenium would need ``chromium-driver`` of the exact same version), waits on
locators (no sleeps on a streaming page), and can rewrite the page's own request (``page.route``)
so the cancel test runs a long generation. Without a browser the test skips with the install
line — except where ``CODA_REQUIRE_BROWSER=1`` (``.ci/run`` sets it): there it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coda.server.playground_routes import ASSETS
from coda.trace import RecentTraceSink, TraceEvent
from tests.conftest import LiveServer

KEY = "pg-secret"


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir(None, EngineConfig(max_num_seqs=8, recent_traces=16))
    engine.start()
    server = LiveServer(create_app(engine, api_key=KEY, manage_engine=False)).start()
    yield server
    server.stop()
    engine.shutdown()


AUTH = {"authorization": f"Bearer {KEY}"}


def test_o1_page_is_self_contained_and_open_but_data_needs_the_key(live: LiveServer) -> None:
    """The page and its assets are served without the key and reference nothing outside;
    the trace endpoint and the API need the key (401 without)."""
    page = httpx.get(live.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for src in re.findall(r'(?:src|href)="([^"]+)"', page.text):
        assert src.startswith("/playground/"), src
        assert httpx.get(live.url + src).status_code == 200
    for asset in ASSETS.iterdir():
        # NOTE: an SVG's namespace name is an identifier, never fetched
        text = asset.read_text(encoding="utf-8").replace('xmlns="http://www.w3.org/2000/svg"', "")
        assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text), asset
    assert httpx.get(live.url + "/playground/..%2Fplayground_routes.py").status_code == 404
    assert httpx.get(live.url + "/v1/traces/nope").status_code == 401
    assert httpx.get(live.url + "/v1/traces/nope", headers=AUTH).status_code == 404
    assert httpx.get(live.url + "/metrics").status_code == 401


def test_c1_o1_cancel_endpoint_and_trace_rows(live: LiveServer) -> None:
    """A streaming chat cancelled through POST /v1/requests/{id}/cancel ends ``cancelled``
    (cause client); its trace has the lifecycle and the three cancel moments in order."""
    body: dict[str, Any] = {"model": "default_model", "stream": True, "max_tokens": 1500,
                            "ignore_eos": True, "seed": 1,
                            "messages": [{"role": "user", "content": "Talk."}]}
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as resp:
            rid = resp.headers["x-request-id"]
            final = None
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and \
                        final is None:
                    assert c.post(f"/v1/requests/{rid}/cancel").json()["cancelled"] is True
                    final = False
                if "coda" in chunk:
                    final = chunk["coda"]
        assert isinstance(final, dict) and final["finish_reason"] == "cancelled"
        rows = c.get(f"/v1/traces/{rid}").json()["rows"]
    kinds = [r["kind"] for r in rows]
    moments = [kinds.index(k) for k in ("cancel.requested", "cancel.observed",
                                        "cancel.effective", "terminal")]
    assert moments == sorted(moments)
    assert rows[kinds.index("cancel.requested")]["cause"] == "client"
    states = [r["to"] for r in rows if r["kind"] == "lifecycle"]
    assert states[:3] == ["QUEUED", "PREFILLING", "DECODING"] and states[-1] == "CANCELLED"


@given(st.lists(st.tuples(st.integers(0, 6), st.sampled_from(
    ["token.selected", "stream.delta", "lifecycle", "terminal"])), max_size=80),
       st.integers(1, 4), st.integers(1, 6))
def test_o1_recent_trace_is_bounded(events: list[tuple[int, str]], max_requests: int,
                                    max_rows: int) -> None:
    """For all event sequences: at most ``max_requests`` requests are kept (the oldest
    first-seen one evicted), each keeps its first ``max_rows`` rows plus every lifecycle /
    terminal row, the rest counted as dropped (oracle: a plain list-based model)."""
    sink = RecentTraceSink(max_requests, max_rows)
    model: dict[str, tuple[list[str], int]] = {}  # NOTE: insertion order = first seen
    for rid, kind in events:
        sink.record(TraceEvent(f"r{rid}", kind, {}))
        key = f"r{rid}"
        if key not in model:
            model[key] = ([], 0)
            while len(model) > max_requests:
                del model[next(iter(model))]
        rows, dropped = model[key]
        if len(rows) < max_rows or kind in ("lifecycle", "terminal"):
            rows.append(kind)
        else:
            model[key] = (rows, dropped + 1)
    for rid in range(7):
        found = sink.rows(f"r{rid}")
        expect = model.get(f"r{rid}")
        if expect is None:
            assert found is None
            continue
        assert found is not None
        assert ([e.kind for e in found[0]], found[1]) == expect


# -- the real browser ------------------------------------------------------------------------
def _chromium() -> str | None:
    for name in (os.environ.get("CODA_CHROMIUM"), "chromium", "chromium-browser"):
        if name and (path := shutil.which(name)):
            return path
    return None


@pytest.fixture(scope="module")
def browser_path() -> str:
    path = _chromium()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        path = None
    if path is None:
        msg = ("no browser for the playground test: apt-get update && apt-get install -y "
               "chromium; pip install playwright")
        if os.environ.get("CODA_REQUIRE_BROWSER") == "1":
            pytest.fail(msg)  # NOTE: CI installs it (.ci/run); a skip there would hide a bug
        pytest.skip(msg)
    return path


def test_o1_c1_playground_in_a_real_browser(live: LiveServer, browser_path: str,
                                            tmp_path: Path) -> None:
    """Type the key, chat (text streams in over several updates), read the outcome and the
    lifecycle timeline; then cancel a long second answer and see the three cancel moments."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path,
                                    args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        outside: list[str] = []
        page.on("request", lambda r: None if r.url.startswith(live.url) else
                outside.append(r.url))
        page.goto(live.url + "/")
        page.fill("#api-key", KEY)
        page.dispatch_event("#api-key", "change")
        expect(page.locator("#model")).to_contain_text("default_model")
        # count text updates of the streaming bubble
        page.evaluate("""() => { window.__updates = 0; new MutationObserver(() =>
            window.__updates++).observe(document.getElementById('transcript'),
            {subtree: true, characterData: true, childList: true}); }""")
        page.fill("#prompt", "What does 'hacker' mean?")
        page.fill("#stop", "\n".join(["zzz-never", "\u00a7\u00a7"]))
        page.fill("#max-tokens", "48")
        page.fill("#seed", "7")
        page.click("#send")
        expect(page.locator("#finish-reason")).not_to_have_text("…", timeout=60_000)
        reason = page.inner_text("#finish-reason")
        answer = page.inner_text("#transcript .msg.assistant .text")
        # NOTE: "–" is an ending without a coda object (an error: the bubble says which)
        assert reason in ("eos", "max_output_tokens", "stop_sequence"), (reason, answer)
        assert answer and page.evaluate("window.__updates") >= 3
        assert page.input_value("#prompt") == ""  # issue 23: the sent prompt leaves the box
        expect(page.locator("#timeline li[data-kind='terminal']")).to_have_count(1)
        for state in ("QUEUED", "PREFILLING", "DECODING", "DRAINING"):
            expect(page.locator(f"#timeline-bar div[data-state='{state}']")).to_have_count(1)
        assert page.inner_text("#wire-reason") in ("stop", "length")
        assert "selected_tokens" in page.inner_text("#usage")
        page.screenshot(path=str(tmp_path / "playground-chat.png"), full_page=True)

        # second answer: long (the test adds ignore_eos to the page's own request), cancelled
        def long_answer(route: Any) -> None:
            body = json.loads(route.request.post_data or "{}")
            route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))

        page.route("**/v1/chat/completions", long_answer)
        page.fill("#prompt", "Tell me a long story.")
        page.fill("#max-tokens", "1500")
        page.click("#send")
        expect(page.locator("#transcript .msg.assistant.streaming .text")).not_to_have_text(
            "", timeout=60_000)
        page.click("#cancel")
        expect(page.locator("#finish-reason")).to_have_text("cancelled", timeout=60_000)
        # NOTE: the timeline comes from the trace endpoint after the stream ends: wait for it
        expect(page.locator("#cancel-times")).to_contain_text("effective", timeout=60_000)
        times = page.inner_text("#cancel-times")
        for moment in ("requested", "observed", "effective"):
            assert moment in times, times
        expect(page.locator("#timeline-bar div[data-state='CANCEL_REQUESTED']")).to_have_count(1)
        assert page.inner_text("#wire-reason") == "length"
        time.sleep(1.2)  # NOTE: one more /metrics poll, so the live view shows a rate
        assert page.inner_text("#m-running") != "–"
        page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
        if os.environ.get("CODA_PLAYGROUND_SCREENSHOT"):
            page.screenshot(path=os.environ["CODA_PLAYGROUND_SCREENSHOT"], full_page=True)
        browser.close()
    assert not outside, outside
