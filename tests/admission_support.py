"""A full waiting queue for the admission tests (docs/api.md, "Overload"; SPEC L5)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from tests.conftest import LiveServer


@contextlib.contextmanager
def queue_full(live: LiveServer, engine: Any, model: str) -> Iterator[dict[str, Any]]:
    """On a one-slot engine behind ``max_waiting=1``: one completion streaming (300 tokens)
    and one waiting; inside, the queue is full. Yields the streamed request's body."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 300, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as first:
        lines = first.iter_lines()
        while '"text"' not in next(lines):  # NOTE: the first request is running
            pass
        second = threading.Thread(target=httpx.post, args=(live.url + "/v1/completions",),
                                  kwargs={"json": {**body, "stream": False, "max_tokens": 2},
                                          "timeout": 60})
        second.start()
        deadline = time.monotonic() + 10
        while engine.stats().num_waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        yield body
    second.join(60)
