"""Ollama's ``keep_alive`` is a number of seconds or a Go duration string, and Ollama refuses
any other string with a 400 in Go's words (SPEC P1: a parameter is never silently ignored).
Coda accepted ``"abc"``, ``"10"`` (no unit) or ``""`` and ignored them."""

from __future__ import annotations

import ollama
import pytest

from coda.server.ollama_schemas import duration_s
from coda.server.ollama_wire import keep_alive_zero


@pytest.mark.parametrize(("text", "seconds"), [
    ("0", 0.0), ("0s", 0.0), ("0ms", 0.0), ("5m", 300.0), ("1.5h", 5400.0),
    ("2h45m", 9900.0), ("300ms", 0.3), ("-1s", -1.0), ("+2s", 2.0), (".5s", 0.5),
    ("1µs", 1e-6)])
def test_p1_go_durations_read_as_go_reads_them(text: str, seconds: float) -> None:
    """P1: what Go's time.ParseDuration takes, in seconds; a zero one unloads (keep_alive 0)."""
    assert duration_s(text) == pytest.approx(seconds)
    assert keep_alive_zero(text) is (seconds == 0)


@pytest.mark.parametrize(("text", "why"), [
    ("abc", "invalid"), ("", "invalid"), ("5mm", "invalid"), (".", "invalid"),
    ("10", "missing unit in"), ("-1", "missing unit in"), ("1h30", "missing unit in")])
def test_p1_strings_go_refuses_are_refused_in_its_words(text: str, why: str) -> None:
    """P1: what Go refuses, with Go's message."""
    with pytest.raises(ValueError, match=f'time: {why} duration "{text}"'):
        duration_s(text)


def test_p1_a_bad_keep_alive_is_a_400_on_generate_chat_and_embed(
        smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """P1: through the official client, a keep_alive Ollama refuses is a 400 naming it on
    every endpoint that takes one; numbers and Go durations still run."""
    calls = [lambda ka: smollm_ollama.generate(model=smollm_name, prompt="hi", keep_alive=ka,
                                               options={"num_predict": 1}),
             lambda ka: smollm_ollama.chat(model=smollm_name, keep_alive=ka,
                                           messages=[{"role": "user", "content": "hi"}],
                                           options={"num_predict": 1}),
             lambda ka: smollm_ollama.embed(model=smollm_name, input="hi", keep_alive=ka)]
    for call in calls:
        with pytest.raises(ollama.ResponseError) as err:
            call("abc")
        assert err.value.status_code == 400
        assert 'keep_alive' in err.value.error and 'invalid duration "abc"' in err.value.error
        with pytest.raises(ollama.ResponseError, match="missing unit"):
            call("10")
        for fine in ("5m", "1h30m", -1, 30):
            call(fine)
