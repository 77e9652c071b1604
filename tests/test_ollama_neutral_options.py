"""Ollama `options` a client sends at their defaults are accepted where they change nothing
(docs/api.md "Ollama API": samplers Coda lacks are a 400 *unless neutral*; SPEC P1: a
parameter is never silently ignored, so a window that would change the output is still a 400).

`repeat_last_n` is the window of Ollama's repeat penalty (default 64; -1 = the whole context)
and `penalize_newline` whether newlines are penalized with it: with no repeat penalty
(`repeat_penalty` unset or 1) neither changes any output, and `repeat_last_n: -1` is Coda's
own rule (the penalty covers the whole sequence). They were refused whatever their value.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

MODEL = "tiny-chat"


def _generate(live: Any, options: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.url + "/api/generate", timeout=60, json={
        "model": MODEL, "prompt": "Hi", "stream": False,
        "options": {"num_predict": 2, "temperature": 0, **options}})


@pytest.mark.parametrize("options", [
    {"repeat_last_n": 64},
    {"repeat_last_n": 64, "repeat_penalty": 1.0},
    {"repeat_last_n": 0, "penalize_newline": True},
    {"repeat_last_n": -1, "repeat_penalty": 1.1},
    {"penalize_newline": True, "repeat_penalty": 1.0},
    {"repeat_last_n": 64, "penalize_newline": True, "mirostat": 0, "typical_p": 1.0,
     "tfs_z": 1.0},
])
def test_p1_ollama_default_window_options_are_accepted_when_neutral(
        server_live: Any, options: dict[str, Any]) -> None:
    r = _generate(server_live, options)
    assert r.status_code == 200, r.text
    assert r.json()["done"] is True


@pytest.mark.parametrize(("options", "named"), [
    ({"repeat_last_n": 64, "repeat_penalty": 1.1}, "repeat_last_n"),
    ({"repeat_last_n": 0, "repeat_penalty": 1.1}, "repeat_last_n"),
    ({"penalize_newline": False, "repeat_penalty": 1.1}, "penalize_newline"),
    ({"mirostat": 2}, "mirostat"),
])
def test_p1_ollama_window_that_would_change_the_output_is_still_a_400(
        server_live: Any, options: dict[str, Any], named: str) -> None:
    r = _generate(server_live, options)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"], r.json()


def test_p1_ollama_same_output_with_and_without_the_neutral_window(server_live: Any) -> None:
    """Greedy, the answer with `repeat_last_n: 64` (no penalty) equals the answer without."""
    a = _generate(server_live, {"num_predict": 6})
    b = _generate(server_live, {"num_predict": 6, "repeat_last_n": 64})
    assert a.status_code == b.status_code == 200
    assert a.json()["response"] == b.json()["response"]
