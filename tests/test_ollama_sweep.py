"""What a sweep of the Ollama API with the official ``ollama`` client found (docs/api.md
"Ollama API"; SPEC P1): each a 400 in Ollama's ``{"error": ...}`` shape, on the real SmolLM2
server over loopback.

- ``raw: true`` with ``system``: the system text was dropped without a word (Ollama drops it
  too, as a raw prompt has no template); P1: a parameter is never silently ignored.
- A validator's message (``keep_alive: "abc"``) carried pydantic's ``Value error, `` before
  Go's words, where the docs promise Ollama's ``time: invalid duration "abc"``.
"""

from __future__ import annotations

import ollama
import pytest


def test_p1_raw_with_system_is_a_400_naming_system(smollm_ollama: ollama.Client,
                                                   smollm_name: str) -> None:
    """P1: a raw prompt is sent as is, so its ``system`` would be dropped: a 400 naming
    ``system``; without ``raw`` the same system is rendered (200)."""
    with pytest.raises(ollama.ResponseError) as exc:
        smollm_ollama.generate(model=smollm_name, prompt="Hi", raw=True, system="Be brief.",
                               options={"num_predict": 2})
    assert exc.value.status_code == 400
    assert exc.value.error.startswith("system: not used with raw: true")
    ok = smollm_ollama.generate(model=smollm_name, prompt="Hi", system="Be brief.",
                                options={"num_predict": 2})
    assert ok.done and ok.eval_count == 2


def test_p1_keep_alive_error_is_gos_words(smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """P1: a ``keep_alive`` Go cannot parse is a 400 in Go's words after the field's name,
    nothing of pydantic's between."""
    with pytest.raises(ollama.ResponseError) as exc:
        smollm_ollama.chat(model=smollm_name, messages=[{"role": "user", "content": "Hi"}],
                           keep_alive="abc", options={"num_predict": 2})
    assert exc.value.status_code == 400
    assert exc.value.error == 'keep_alive: time: invalid duration "abc"'
