"""A grammar the grammar library cannot finish never freezes the server (S1, L4, L5; "never a
hang or a frozen server"; :mod:`coda.engine.grammar_guard`).

llguidance 1.9.1 loops forever computing the mask of a Lark grammar whose greedy terminal can
never give way to the next (``A: /a+/`` then ``B: /ac/``: the forced bytes ``aaa…`` never end);
before the bound, one such request froze the engine thread, and every later request waited
forever. Served by a real ``coda serve`` process (the abandoned native call keeps a core busy
until its process exits, so not in the test session's own process), driven by the official
``openai`` client: stuck at the first mask, the request is a 400 naming ``response_format``;
stuck after the first token, it ends ``model_error`` saying why; either way the next request is
answered.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.random_checkpoint import make_random_checkpoint
from tests.scaleout_support import free_port

STUCK_AT_START = 'start: A B\nA: /a+/\nB: /ac/\n'
STUCK_AFTER_ONE = 'start: ("x" | "y") A B\nA: /a+/\nB: /ac/\n'


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # NOTE: the grammar tests' checkpoint (its tokenizer is one llguidance reads)
    model = make_random_checkpoint(
        tmp_path_factory.mktemp("stuck") / "tiny-chat", hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coda.cli", "serve", "--model", str(model),
         "--port", str(port), "--max-num-seqs", "4", "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise AssertionError((proc.stderr.read() if proc.stderr else b"")[-3000:])
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "coda serve did not start"
            time.sleep(0.3)
        yield base
    finally:
        proc.kill()
        proc.wait(30)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60)


def _chat(url: str, **extra: Any) -> Any:
    return _client(url).chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        seed=1, **extra)


def _plain_request_answered(url: str) -> None:
    r = _chat(url)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_grammar_stuck_at_its_first_mask_is_a_400_and_the_server_goes_on_s1_l5(
        url: str) -> None:
    """S1/L5: the first mask is computed at submit with a bound: a 400 naming the field."""
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        _chat(url, response_format={"type": "lark", "lark": STUCK_AT_START})
    body: Any = err.value.body
    assert body["param"] == "response_format", body
    assert "did not finish" in body["message"], body
    assert time.monotonic() - t0 < 30
    _plain_request_answered(url)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_stuck_after_its_first_token_ends_model_error_and_the_server_goes_on_l4(
        url: str, stream: bool) -> None:
    """L4/L5: a mask stuck on the engine thread ends that request ``model_error`` with the
    reason (the matcher is abandoned, never touched again); the other requests go on."""
    fmt = {"type": "lark", "lark": STUCK_AFTER_ONE}
    if stream:
        with pytest.raises(openai.APIError) as err:
            for _ in _client(url).chat.completions.create(
                    model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                    max_tokens=8, seed=1, response_format=fmt, stream=True):
                pass
        assert "did not finish" in str(err.value), err.value
    else:
        with pytest.raises(openai.InternalServerError) as err2:
            _chat(url, response_format=fmt)
        assert "did not finish" in str(err2.value.body), err2.value.body
    _plain_request_answered(url)
